"""How a streamed completion ended, as the failure tests count it: the one classifier of the serve fault tests."""


def stream_outcome(events: list) -> str:
    """events: each `data:` line's JSON in order, the string "[DONE]" for the terminator. 'ok'; 'in-band' (an
    error event, the choice finished with "error", then [DONE]); or 'unclean: ...' (what a client cannot handle)."""
    if events[-1:] != ["[DONE]"]:
        return "unclean: stream cut without [DONE]"
    body = events[:-1]
    if not any("error" in e for e in body):
        return "ok"
    finish = {c["finish_reason"] for e in body for c in e.get("choices", [])} - {None}
    return "in-band" if finish == {"error"} else "unclean: error event without finish"
