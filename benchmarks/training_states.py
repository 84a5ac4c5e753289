"""Which Block Buffer states each MultiTF variant trains on, against the states MultiBD decoding visits.

Claims (d) and (e) compare noise-schedulers and group-layouts by AUP; this measures the mechanism the paper
gives for them (sec:method: training states should match the states the decoder is in). A state is read from
what the model sees, not from the scheduler's draw: a block's masked fraction is its masked tokens over the block
size (k / B, as the decoder's blocks are), and a pair is two consecutive blocks of one noise-group in training,
two consecutive ACTIVE slots of the buffer in decoding (the earlier block first).

For each variant of a `mbd reproduce` run (its seed-0 layouts, its seed-0 model's traces at the default MultiBD
operating point) it prints:
- group sizes: share of noise-groups with 1, 2, 3, ... blocks; decoding: share of forwards with 1, 2, 3, ...
  ACTIVE blocks (forwards with none, which only store the cache, left out);
- TV(pairs): total variation distance between the training pairs' and decoding pairs' distributions over
  (first, second) masked fractions; TV(blocks): the same over single blocks' masked fractions;
- most frequent pairs: the three commonest (earlier, later) masked fractions and their shares;
- rising pairs: share of pairs whose second block is at least as masked as the first;
- decoding pairs / blocks unseen: share of decoding's pairs (blocks) whose masked fractions no training row has
  (with the paper's n_k = floor(B t_k) and t_eff < 1, no trained block is fully masked at B = 4).

    python -m benchmarks.training_states runs/reproduce/a5-c5-d5-e5-<hash>
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pyarrow.parquet as pq


def masked_fractions(noisy: np.ndarray, clean: np.ndarray, mask_id: int, block_size: int, blocks: int) -> np.ndarray:
    """Masked tokens / block_size for each of `blocks` blocks (a short last block counts its missing tokens as
    unmasked)."""
    masked = np.zeros(blocks * block_size, bool)
    n = min(len(noisy), blocks * block_size)
    masked[:n] = (noisy[:n] == mask_id) & (clean[:n] != mask_id)
    return masked.reshape(blocks, block_size).sum(1) / block_size


def training_states(rows: Iterable[dict], mask_id: int, block_size: int) -> tuple[Counter, Counter, Counter]:
    """(group sizes, in-group consecutive pairs, member blocks' fractions) over layout rows."""
    sizes, pairs, singles = Counter(), Counter(), Counter()
    for r in rows:
        group = np.asarray(r["block_group"])
        frac = masked_fractions(np.asarray(r["noisy_ids"]), np.asarray(r["clean_ids"]), mask_id, block_size,
                                len(group))
        for g in np.unique(group[group >= 0]):
            f = frac[group == g]
            sizes[len(f)] += 1
            singles.update(float(x) for x in f)
            pairs.update((float(a), float(b)) for a, b in zip(f[:-1], f[1:]))
    return sizes, pairs, singles


def decoding_states(traces: Iterable[Sequence[dict]]) -> tuple[Counter, Counter, Counter]:
    """(ACTIVE blocks per forward, consecutive ACTIVE pairs, ACTIVE blocks' fractions) over request traces."""
    sizes, pairs, singles = Counter(), Counter(), Counter()
    for trace in traces:
        for e in trace:
            active = [float(r) for s, r in zip(e["states"], e["mask_ratio"]) if s == "ACTIVE"]
            if active:
                sizes[len(active)] += 1
            singles.update(active)
            pairs.update(zip(active[:-1], active[1:]))
    return sizes, pairs, singles


def total_variation(p: Counter, q: Counter) -> float:
    """Half the L1 distance between the two normalised distributions."""
    np_, nq = sum(p.values()), sum(q.values())
    return 0.5 * sum(abs(p[k] / np_ - q[k] / nq) for k in set(p) | set(q))


def rising_share(pairs: Counter) -> float:
    return sum(n for (a, b), n in pairs.items() if b >= a) / sum(pairs.values())


def unseen_share(train: Counter, dec: Counter) -> float:
    """Share of decoding's states that never occur in training."""
    return sum(n for k, n in dec.items() if k not in train) / sum(dec.values())


def top_pairs(pairs: Counter, k: int = 3) -> str:
    total = sum(pairs.values())
    return ", ".join(f"({a:g}, {b:g}) {100 * n / total:.1f}%" for (a, b), n in pairs.most_common(k))


def shares(sizes: Counter, upto: int) -> str:
    total = sum(sizes.values())
    return " / ".join(f"{sizes[k] / total:.2f}" for k in range(1, upto + 1))


def read_rows(layouts: Path) -> list[dict]:
    cols = ["block_group", "noisy_ids", "clean_ids"]
    return [r for f in sorted((layouts / "rows").glob("*.parquet")) for r in pq.read_table(f, columns=cols).to_pylist()]


def read_traces(path: Path) -> list[list[dict]]:
    return [json.loads(line)["trace"] for line in path.read_text().splitlines() if line.strip()]


def table(run: Path, upto: int = 4) -> str:
    cfg = json.loads((run / "variants" / "chain" / "model" / "config.json").read_text())
    mask_id, block_size = cfg["mask_token_id"], cfg["block_size"]
    lines = [f"| variant (seed 0) | source | blocks per group / per forward, 1 .. {upto} | rising pairs | "
             "most frequent pairs | TV(pairs) | TV(blocks) | decoding pairs unseen | decoding blocks unseen |",
             "|---|---|---|---:|---|---:|---:|---:|---:|"]
    for v in sorted(p.name for p in (run / "variants").iterdir() if "-s" not in p.name):
        trace = run / "eval" / "traces" / f"mbd-{v}" / f"mbd-{v}" / "tinymath.jsonl"
        if not (run / "variants" / v / "layouts" / "rows").is_dir() or not trace.is_file():
            continue
        t_sizes, t_pairs, t_blocks = training_states(read_rows(run / "variants" / v / "layouts"), mask_id, block_size)
        d_sizes, d_pairs, d_blocks = decoding_states(read_traces(trace))
        lines += [f"| {v} | training | {shares(t_sizes, upto)} | {rising_share(t_pairs):.3f} | {top_pairs(t_pairs)} | "
                  f"{total_variation(t_pairs, d_pairs):.3f} | {total_variation(t_blocks, d_blocks):.3f} | "
                  f"{unseen_share(t_pairs, d_pairs):.3f} | {unseen_share(t_blocks, d_blocks):.3f} |",
                  f"| {v} | decoding | {shares(d_sizes, upto)} | {rising_share(d_pairs):.3f} | "
                  f"{top_pairs(d_pairs)} | | | | |"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a `mbd reproduce` run folder (runs/reproduce/<registration>)")
    print(table(ap.parse_args(argv).run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
