"""What differs between /v1/completions and /v1/chat/completions, and nothing else: how the request's prompts are
encoded and how pieces of text become that endpoint's JSON (a chunk, the usage tail, the heads, the whole
response). The ingress runs one path for both (`OpenAIIngress._generate`) with one of these."""

from __future__ import annotations

from typing import Any, Callable, Protocol

from mbd.tokenizer import Tokenizer
from serve_app.choices import Choice, Piece
from serve_app.convert import RequestConverter
from serve_app.protocol import (MASK_GLYPH, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, CompletionChoice,
                                CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage, MBDStats,
                                Provisional, ProvisionalBlock, TokenLogprob, Usage, new_id, now)

INLINE_COST = 1024  # characters or tokens (de)tokenized on the event loop; more go to the tokenizer pool
MESSAGE_COST = 64  # a chat message's own cost in the chat template's render, however short its content


def _size(prompt: str | list) -> int:
    """Characters or token ids in a prompt field (a string, ids, or a list of either)."""
    return len(prompt) if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else \
        sum(_size(p) for p in prompt)


def chat_cost(messages: list[dict[str, Any]]) -> int:
    """What rendering and tokenizing a chat costs, in INLINE_COST's units: its characters, plus MESSAGE_COST per
    message (the template loops over messages: 140k empty ones must not render on the event loop)."""
    return sum(len(m["content"]) + MESSAGE_COST for m in messages)


class Ingress(Protocol):
    """What a render uses of the ingress (serve_app/ingress.py `OpenAIIngress`, which imports this module)."""

    tok: Tokenizer
    convert: RequestConverter
    name: str

    async def sync(self, cost: int, fn: Callable, *args: Any) -> Any: ...


class Render:
    """One request's endpoint-specific side; `ing` lends the tokenizer, the model name and the mask id."""

    prefix = ""

    def __init__(self, ing: Ingress, req: Any):
        self.ing, self.req, self.tok = ing, req, ing.tok
        self.rid, self.created = new_id(self.prefix), now()

    def _text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def provisional(self, p: Piece) -> Provisional | None:
        """A piece's not-yet-final blocks as the client sees them (masked positions: None / MASK_GLYPH)."""
        if p.provisional is None:
            return None
        mask = self.ing.convert.limits.mask_id
        blocks = [ProvisionalBlock(token_ids=[None if t == mask else t for t in b], text="".join(
            MASK_GLYPH if t == mask else self.tok.decode([t]) for t in b)) for b in p.provisional]
        return Provisional(committed_tokens=p.committed, blocks=blocks)

    def heads(self, choices: list[Choice]) -> list[Any]:
        return []

    @staticmethod
    def full(c: Choice, text: str, logprobs: bool) -> Piece:
        """A finished choice as one piece."""
        return Piece(c.index, text, c.token_ids, c.logprobs[: len(c.token_ids)] if logprobs else None,
                     top_logprobs=c.top_logprobs[: len(c.token_ids)] or None)


class CompletionRender(Render):
    prefix = "cmpl"
    req: CompletionRequest

    def __init__(self, ing: Ingress, req: CompletionRequest):
        super().__init__(ing, req)
        self.offsets: dict[int, int] = {}  # per choice: characters streamed so far (text_offset)

    async def prompts(self) -> tuple[list[list[int]], list[str]]:
        return await self.ing.sync(_size(self.req.prompt), self.ing.convert.encode_prompts, self.req.prompt)

    def _logprobs(self, p: Piece, offset: int) -> CompletionLogprobs | None:
        if p.logprobs is None:
            return None
        tokens = [self._text(t) for t in p.token_ids]
        offsets = [offset + sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
        tops = [{self._text(i): v for i, v in top} for top in p.top_logprobs or [[]] * len(tokens)]
        return CompletionLogprobs(tokens=tokens, token_logprobs=p.logprobs, text_offset=offsets,
                                  top_logprobs=tops if self.req.logprobs is not None else None)

    def _choice(self, p: Piece, offset: int, provisional: Provisional | None = None,
                finish_reason: str | None = None) -> CompletionChoice:
        return CompletionChoice(index=p.index, text=p.text, logprobs=self._logprobs(p, offset),
                                finish_reason=finish_reason or p.finish_reason, provisional=provisional,
                                token_ids=p.token_ids if self.req.return_token_ids else None)

    def chunk(self, p: Piece) -> CompletionResponse:
        choice = self._choice(p, self.offsets.get(p.index, 0), self.provisional(p))
        self.offsets[p.index] = self.offsets.get(p.index, 0) + \
            (sum(len(t) for t in choice.logprobs.tokens) if choice.logprobs else 0)
        return CompletionResponse(id=self.rid, created=self.created, model=self.ing.name, choices=[choice])

    def tail(self, u: Usage | None, stats: MBDStats) -> CompletionResponse:
        return CompletionResponse(id=self.rid, created=self.created, model=self.ing.name, choices=[], usage=u,
                                  mbd=stats)

    def whole(self, choices: list[Choice], texts: list[str], u: Usage, stats: MBDStats) -> CompletionResponse:
        out = [self._choice(self.full(c, text, self.req.logprobs is not None), 0, finish_reason=c.finish_reason)
               for c, text in zip(choices, texts)]
        return CompletionResponse(id=self.rid, created=self.created, model=self.ing.name, choices=out, usage=u,
                                  mbd=stats)


class ChatRender(Render):
    prefix = "chatcmpl"
    req: ChatCompletionRequest

    async def prompts(self) -> tuple[list[list[int]], list[str]]:
        messages = self.ing.convert.messages(self.req)
        return [await self.ing.sync(chat_cost(messages), self.ing.convert.encode_chat, messages)], ["messages"]

    def _logprobs(self, p: Piece) -> ChatLogprobs | None:
        if p.logprobs is None:
            return None
        tokens = [self._text(t) for t in p.token_ids]
        tops = p.top_logprobs or [[]] * len(tokens)
        return ChatLogprobs(content=[TokenLogprob(token=t, logprob=lp, bytes=list(t.encode()), top_logprobs=[
            {"token": self._text(i), "logprob": v, "bytes": list(self._text(i).encode())} for i, v in top])
            for t, lp, top in zip(tokens, p.logprobs, tops)])

    def heads(self, choices: list[Choice]) -> list[ChatCompletionChunk]:
        return [ChatCompletionChunk(id=self.rid, created=self.created, model=self.ing.name, choices=[
            ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))]) for c in choices]

    def chunk(self, p: Piece) -> ChatCompletionChunk:
        delta = DeltaMessage(content=p.text) if p.text or not p.finish_reason else DeltaMessage()
        return ChatCompletionChunk(id=self.rid, created=self.created, model=self.ing.name, choices=[ChatChunkChoice(
            index=p.index, delta=delta, logprobs=self._logprobs(p), finish_reason=p.finish_reason,
            token_ids=p.token_ids if self.req.return_token_ids else None, provisional=self.provisional(p))])

    def tail(self, u: Usage | None, stats: MBDStats) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.rid, created=self.created, model=self.ing.name, choices=[], usage=u,
                                   mbd=stats)

    def whole(self, choices: list[Choice], texts: list[str], u: Usage, stats: MBDStats) -> ChatCompletionResponse:
        out = []
        for c, text in zip(choices, texts):
            full = self.full(c, text, bool(self.req.logprobs))
            out.append(ChatChoice(index=c.index, message=AssistantMessage(content=text), logprobs=self._logprobs(full),
                                  finish_reason=c.finish_reason,
                                  token_ids=full.token_ids if self.req.return_token_ids else None))
        return ChatCompletionResponse(id=self.rid, created=self.created, model=self.ing.name, choices=out, usage=u,
                                      mbd=stats)
