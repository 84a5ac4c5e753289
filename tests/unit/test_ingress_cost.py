"""Which chats the ingress renders on its event loop: the cost counts each message, not only its characters, so a
body of many empty messages goes to the tokenizer pool."""

from serve_app.render import INLINE_COST, MESSAGE_COST, chat_cost


def test_every_message_costs_something_however_short():
    one = [{"role": "user", "content": "x" * 100}]
    assert chat_cost(one) == 100 + MESSAGE_COST
    empty = [{"role": "user", "content": ""}] * 140_000
    assert chat_cost(empty) == 140_000 * MESSAGE_COST > INLINE_COST  # to the pool
    few = [{"role": "user", "content": "hi"}] * 4
    assert chat_cost(few) == 4 * (2 + MESSAGE_COST) <= INLINE_COST  # small: inline
