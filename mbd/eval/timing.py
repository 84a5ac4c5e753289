"""Side-by-side tokens-per-second: every method decodes the same prompts in interleaved rounds in one process.

A sweep times each cell whenever its worker reaches it, so on a shared or loaded machine two cells' TPS differ by
the load of their moments as much as by their decoding; a TPS column built from them can contradict its own TPF
column. Here the methods take turns (round r starts at method r mod M: ABCD, BCDA, CDAB, ...) so slow drifts of the
machine fall on every method alike, and each method's TPS is the median over rounds, reported with its min-max
spread. TPS is the sweep's definition (generated tokens / summed request latency, `metrics.summarize`)."""

from __future__ import annotations

import statistics
from typing import Callable, Mapping, Sequence

from pydantic import BaseModel, Field

from mbd.config import DecodeConfig

__all__ = ["TpsStat", "Decoder", "interleaved_order", "interleaved_tps", "engine_decoder"]

Decoder = Callable[[], tuple[int, float]]  # one timed decode: (generated tokens, summed request latency in s)


class TpsStat(BaseModel):
    """One method's TPS over interleaved rounds."""

    median: float
    low: float = Field(description="min over rounds")
    high: float = Field(description="max over rounds")
    per_round: list[float]

    @classmethod
    def of(cls, samples: Sequence[float]) -> "TpsStat":
        if not samples:
            raise ValueError("samples is empty: time at least one round")
        return cls(median=statistics.median(samples), low=min(samples), high=max(samples), per_round=list(samples))


def interleaved_order(names: Sequence[str], rounds: int) -> list[str]:
    """The call order: round r runs the methods rotated by r, so no method always runs first or last."""
    n = len(names)
    return [names[(r + i) % n] for r in range(rounds) for i in range(n)]


def interleaved_tps(decoders: Mapping[str, Decoder], rounds: int) -> dict[str, TpsStat]:
    """Per method, the median and spread of tokens / latency over `rounds` interleaved decodes."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: need at least 1")
    samples: dict[str, list[float]] = {k: [] for k in decoders}
    for name in interleaved_order(list(decoders), rounds):
        tokens, seconds = decoders[name]()
        samples[name].append(tokens / seconds if seconds > 0 else 0.0)
    return {k: TpsStat.of(v) for k, v in samples.items()}


def engine_decoder(engine, prompts: Sequence[Sequence[int]], params: DecodeConfig) -> Decoder:
    """A Decoder over an engine (batched as its max_batch_rows allows); one untimed short request first, so that
    first-call costs land in no round."""
    engine.generate([list(prompts[0])], params.model_copy(update={"max_new_tokens": 8}))

    def run() -> tuple[int, float]:
        results = engine.generate([list(p) for p in prompts], params)
        return sum(r.num_generated for r in results), sum(r.wall_time_s for r in results)

    return run
