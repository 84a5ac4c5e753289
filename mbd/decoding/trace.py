"""Decoding traces: what each forward saw, per request, for the paper's fig:train_infer_noise_activity
(panels C-E: how many blocks are active, and at which mask ratios, at inference time).

One entry per forward of the request: the slot states and each ACTIVE slot's mask ratio as fed to the
model, and the committed prefix length (so slot j holds block (prefix_len - aligned_prompt) / B + j).
"""

from __future__ import annotations

from collections import Counter

from mbd.decoding.state import SlotState


def step_entry(states: list[int], masked: list[int], prefix_len: int, block: int) -> dict:
    return {
        "states": [SlotState(s).name for s in states],
        "mask_ratio": [m / block if s == SlotState.ACTIVE else None for s, m in zip(states, masked)],
        "prefix_len": prefix_len,
    }


def summarize(traces: list[list[dict]]) -> dict:
    """Active-block-count histogram and mean mask ratio per active-slot rank over many requests' traces."""
    counts: Counter[int] = Counter()
    ratios: dict[int, list[float]] = {}
    for trace in traces:
        for e in trace:
            active = [r for r in e["mask_ratio"] if r is not None]
            counts[len(active)] += 1
            for rank, r in enumerate(active):
                ratios.setdefault(rank, []).append(r)
    total = sum(counts.values()) or 1
    return {
        "forwards": sum(counts.values()),
        "active_blocks_mean": sum(k * v for k, v in counts.items()) / total,
        "active_blocks_hist": dict(sorted(counts.items())),
        "mask_ratio_by_rank": {k: sum(v) / len(v) for k, v in sorted(ratios.items())},
    }
