"""Where MultiBD loses what SingleBD solves, on the DEV split (`tinymath-dev`, never a test problem).

    python -m benchmarks.multibd_diagnosis --base mbd/assets/tiny --mbd runs/dev_ab/current/seed0/mbd-tiny

Two measurements:
1. Attribution. Every dev problem the base solves under SingleBD and MBD-tiny fails under MultiBD is re-decoded by
   the naive MultiBD reference (`mbd.decoding.naive`, the engine's decisions one request at a time), recording
   every token fill. The first wrong committed token is the first character after which the output is no longer
   a prefix of any valid worked solution (the task writes commutative steps in either order, so "wrong" is
   "no valid solution continues it"; an early EOS is wrong too). It is attributed to the rule that filled it
   (`m2t`: confidence > tau_m2t; `fallback_first`: the top-1 fallback of a slot whose predecessor is complete or
   cached; `fallback_semi`: the top-1 fallback licensed by a semi-complete, unfinished predecessor), its slot in
   the running-set, its block's filled tokens, the preceding block's filled tokens and the mask tokens left in all
   earlier resident blocks (`masks_before`, 3 = 3 or more) when it was filled, and the preceding block's filled
   tokens when its block was activated. The same fields over EVERY fill of those
   decodes give the base rates, so over-represented states stand out.
2. Teacher-forced CE of a block's masked tokens by state (preceding block's masked count m_prev, own masked
   count m_cur), block-causal attention over [clean prefix, preceding block, block], base vs MBD-tiny. SingleBD
   only ever shows the model m_prev = 0; MultiBD also shows m_prev > 0, and m_cur = B is the fresh block that
   every block opens as.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mbd.config import DecodeConfig, EngineConfig, resolve_path
from mbd.decoding.naive import NaiveMultiBD
from mbd.decoding.spec import load_engine_model
from mbd.multitf.records import load_tokenizer, tokenize_record
from mbd.tiny.task import TinyProblem, generate

RULES = ("m2t", "fallback_first", "fallback_semi")


class RecordingNaive(NaiveMultiBD):
    """The naive reference, recording each fill: position -> (rule, slot, own filled, preceding filled, active
    slots, confidence), each block's preceding-block fill when it was activated, and in `predictions` every
    masked position of every forward, filled or not, with the same fields and its top-1 token (filled: its
    rule; not filled: None), so that the confidence of what the decoder did not commit can be scored too."""

    def __init__(self, *a: Any, **k: Any):
        super().__init__(*a, **k)
        self.reset()

    def reset(self) -> None:
        """Forget the previous request's records."""
        self.fills: dict[int, dict] = {}
        self.activated: dict[int, int] = {}
        self.predictions: list[dict] = []
        self.steps = 0

    def update(self, p, logits, tokens, n_tc, first_pos, prompt_len, gen):
        before = tokens[0].tolist()
        out = super().update(p, logits, tokens, n_tc, first_pos, prompt_len, gen)
        after = out[0][0].tolist()
        top = torch.softmax(logits[0].float(), -1).max(-1)  # mask logit already -inf (predict)
        conf, token = top.values.tolist(), top.indices.tolist()
        B, M = self.block, self.mask_id
        blocks = [before[j * B:(j + 1) * B] for j in range(len(before) // B)]
        filled = [B - b.count(M) for b in blocks]
        first_block = first_pos // B
        for j in range(len(blocks)):
            b = first_block + j
            if b not in self.activated:
                self.activated[b] = filled[j - 1] if j > 0 else B
        for i, (x, y) in enumerate(zip(before, after)):
            if x != M:
                continue
            j = i // B
            prev_done = j == 0 or j - 1 < n_tc or filled[j - 1] == B
            rule = None if y == M else ("m2t" if conf[i] > p.tau_m2t else
                                        ("fallback_first" if prev_done else "fallback_semi"))
            state = {"rule": rule, "slot": j, "own_filled": filled[j], "prev_filled": filled[j - 1] if j > 0 else B,
                     "masks_before": min(sum(B - f for f in filled[:j]), 3), "active": len(blocks) - n_tc,
                     "block": first_pos // B + j, "conf": conf[i]}
            self.predictions.append({**state, "pos": first_pos + i, "token": token[i], "step": self.steps})
            if rule is not None:
                self.fills[first_pos + i] = state
        self.steps += 1
        return out


def valid_solutions(fields: dict) -> set[str]:
    prob = TinyProblem(**fields)
    return {prob.solution(s) for s in product([False, True], repeat=4)}


def first_wrong(text: str, valid: set[str], end: str = "\0") -> int | None:
    """Index of the first character of `text` + end that no valid solution + end continues; None if it is one."""
    full, ok = text + end, {v + end for v in valid}
    for i in range(len(full)):
        if not any(v.startswith(full[: i + 1]) for v in ok):
            return i
    return None


def prompt_ids(record: dict, tok: Any, block: int) -> list[int]:
    """The prompt tokens of a tiny task record, templated as in training (what the engine decodes from)."""
    _, ids, prompt_len, _ = tokenize_record(json.dumps({"prompt": record["question"], "response": record["solution"]}),
                                            tok, block, 10_000)
    return ids[:prompt_len]


def attribute(model_dir: Path, cfg: DecodeConfig, records: list[dict]) -> dict:
    """Attribution of the first wrong token of each record's MultiBD decode, plus base rates over every fill."""
    model, _ = load_engine_model(model_dir, EngineConfig(device="cpu", dtype="float32", threads=1))
    tok, mcfg = load_tokenizer(str(model_dir))
    ref = RecordingNaive(model, cfg, tok.stop_token_ids)
    first: list[dict] = []
    base_rate: Counter = Counter()
    for r in records:
        prompt = prompt_ids(r, tok, mcfg.block_size)
        prompt_len = len(prompt)
        ref.reset()
        res = ref.generate(prompt)
        text = tok.decode(res.token_ids)
        for f in ref.fills.values():
            base_rate[(f["rule"], f["slot"], f["prev_filled"], f["masks_before"])] += 1
        i = first_wrong(text, valid_solutions(r["fields"]))
        if i is None:  # the naive decode solved it (a tie the engine broke the other way): nothing to attribute
            continue
        f = ref.fills.get(prompt_len + i)
        if f is None:  # past the generation limit
            continue
        first.append({**f, "char": i, "text": text, "question": r["question"],
                      "prev_filled_at_activation": ref.activated.get(f["block"], mcfg.block_size)})
    return {"first_wrong": first, "base_rate": {"|".join(map(str, k)): v for k, v in base_rate.items()}}


@torch.inference_mode()
def ce_by_state(model_dir: Path, records: list[dict], seed: int = 0) -> dict[str, float]:
    """Mean CE (nats/token) of block k's masked tokens for each (m_prev, m_cur), one random block per record."""
    model, _ = load_engine_model(model_dir, EngineConfig(device="cpu", dtype="float32", threads=1))
    tok, mcfg = load_tokenizer(str(model_dir))
    B, M = mcfg.block_size, mcfg.mask_token_id
    ref = NaiveMultiBD(model, DecodeConfig(buffer_size=2, tau_add=0.5, max_length=256), tok.stop_token_ids,
                       recompute=True)
    rng = np.random.default_rng(seed)
    sums: dict[tuple[int, int], list[float]] = {}
    for r in records:
        _, ids, prompt_len, resp = tokenize_record(json.dumps({"prompt": r["question"], "response": r["solution"]}),
                                                   tok, B, 10_000)
        first = -(-prompt_len // B) + 1  # block k: its predecessor lies wholly in the response
        last = (prompt_len + resp - 1) // B
        if last < first:
            continue
        k = int(rng.integers(first, last + 1))
        prev, cur = ids[(k - 1) * B:k * B], ids[k * B:(k + 1) * B]
        for m_prev, m_cur in product(range(B + 1), range(1, B + 1)):
            pm, cm = set(rng.permutation(B)[:m_prev].tolist()), sorted(rng.permutation(B)[:m_cur].tolist())
            run = [M if i in pm else t for i, t in enumerate(prev)] + [M if i in cm else t for i, t in enumerate(cur)]
            logits = ref.forward(ids[:(k - 1) * B], run, None)[0, B:].float()
            logits[:, M] = float("-inf")
            ce = F.cross_entropy(logits[cm], torch.tensor(cur)[cm], reduction="sum")
            sums.setdefault((m_prev, m_cur), []).append(float(ce) / m_cur)
    return {f"{a},{b}": float(np.mean(v)) for (a, b), v in sorted(sums.items())}


def table(first: list[dict], base_rate: dict[str, int]) -> str:
    """Markdown: first wrong tokens by rule, by slot, by the preceding block's fill, with base rates."""
    total = sum(base_rate.values()) or 1
    lines = [f"first wrong tokens: {len(first)}", "", "| by | value | first wrong | share | share of all fills |",
             "|:---|:---|---:|---:|---:|"]
    by = {"rule": 0, "slot": 1, "prev_filled": 2, "masks_before": 3}
    for key, idx in by.items():
        counts = Counter(str(f[key]) for f in first)
        rates: Counter = Counter()
        for k, v in base_rate.items():
            rates[k.split("|")[idx]] += v
        for value in sorted(set(counts) | set(rates)):
            n = counts.get(value, 0)
            lines.append(f"| {key} | {value} | {n} | {100 * n / max(len(first), 1):.0f}% | "
                         f"{100 * rates.get(value, 0) / total:.0f}% |")
    acts = Counter(f["prev_filled_at_activation"] for f in first)
    lines.append("")
    lines.append("preceding block's filled tokens when the failing block was activated: "
                 + ", ".join(f"{k}: {v}" for k, v in sorted(acts.items())))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="mbd/assets/tiny")
    ap.add_argument("--mbd", required=True, help="the MBD-tiny model directory")
    ap.add_argument("--singlebd", required=True, help="tiny_dev_ab's decoded base SingleBD file (dev outcomes)")
    ap.add_argument("--multibd", required=True, help="tiny_dev_ab's decoded MBD-tiny MultiBD file (same problems)")
    ap.add_argument("--point", default="multibd_ge", help="tiny_dev_ab decode point of --multibd")
    ap.add_argument("--ce-problems", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from benchmarks.tiny_dev_ab import point

    single, multi = (json.loads(Path(p).read_text()) for p in (args.singlebd, args.multibd))
    n = min(single["problems"], multi["problems"])
    records = generate("dev", n, 0)  # the tinymath-dev benchmark's problems, in its order
    lost = [r for r, a, b in zip(records, single["correct"], multi["correct"]) if a and not b]
    print(f"{len(lost)} of {n} dev problems: SingleBD (base) right, MultiBD (MBD-tiny, {args.point}) wrong", flush=True)
    att = attribute(resolve_path(args.mbd), point(args.point), lost)
    print(table(att["first_wrong"], att["base_rate"]), flush=True)
    ce = {name: ce_by_state(resolve_path(path), records[: args.ce_problems])
          for name, path in (("base", args.base), ("mbd", args.mbd))}
    print("\nteacher-forced CE (nats/token) of a block's masked tokens, by (m_prev, m_cur): base / MBD-tiny")
    for state in ce["base"]:
        print(f"  {state}: {ce['base'][state]:.3f} / {ce['mbd'][state]:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"lost": len(lost), "n": n, **att, "ce": ce}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
