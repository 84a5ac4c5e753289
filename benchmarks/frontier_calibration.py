"""Issue 67's diagnosis, on the DEV split only (`tinymath-dev`, never a test problem): MBD-tiny's accuracy-TPF
frontier beyond the shipped point, what commits the first wrong tokens at each point, and how calibrated the top-1
confidence is by state and slot, to tell which limits it: miscalibration (confident and wrong), missing knowledge in
a state (unconfident and wrong there), or the rule (the fallbacks commit the wrong ones).

    python -m benchmarks.frontier_calibration --problems 1000 --json runs/frontier/report.json

1. Frontier: the first --problems dev problems decoded by the engine (`tiny_dev_ab.decode_one`) at every point of
   `POINTS` and SingleBD at tau_m2t 0.95, MBD-tiny's own SingleBD (tau_m2t 0.9) the reference: accuracy (95%
   Wilson), TPF, its ratio to SingleBD's and the paired difference to SingleBD on the same problems
   (`mbd.eval.stats.paired_difference`).
2. First wrong tokens: the problems SingleBD solves and the point fails, re-decoded by the naive reference with
   every fill recorded (`multibd_diagnosis.attribute`: the first character no valid solution continues, its rule,
   slot and block state).
3. Calibration: every problem re-decoded by the naive reference at each point of --diagnose, every masked position
   of every forward recorded (`multibd_diagnosis.RecordingNaive.predictions`). A prediction is right when it equals
   the token of the same weights' greedy SingleBD decode at that position (the end of text where that decode
   stopped): what extension (i) would train towards. It is scored only while the context is that decode's, i.e.
   at every forward up to and including the first that commits a token SingleBD did not write (`off`); later
   positions past SingleBD's end are not scored. A position is a `fork` when the SingleBD text before it admits
   more than one valid next character (a commutative step's operand order, where the other token is as right),
   `forced` when exactly one, `ref_off` when none (SingleBD already wrong); the tables score forced positions.
Everything decoded is kept under --run-dir and reused.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.multibd_diagnosis import RULES, RecordingNaive, attribute, prompt_ids, table, valid_solutions
from benchmarks.tiny_dev_ab import decode_one, tpf
from mbd.config import DecodeConfig, EngineConfig, load_decode, resolve_path, validate
from mbd.eval.calibration import reliability, wilson
from mbd.eval.stats import paired_difference
from mbd.tiny.task import generate

SINGLEBD = "singlebd"  # the reference: configs/decode/tiny_singlebd.yaml (tau_m2t 0.9), MBD-tiny's own weights
SINGLEBD_M2T95 = "singlebd_m2t95"  # the same at tau_m2t 0.95: SingleBD's own accuracy-TPF trade, for comparison
# name -> (tau_add, tau_semi, tau_m2t) over configs/decode/tiny_multibd.yaml (N_buf 4, B 4, strict tests); at B = 4
# tau_add / tau_semi 0.5 pass at 3 of 4 tokens, 0.49 at 2, 0.24 (and 0.10) at 1
POINTS: dict[str, tuple[float, float, float]] = {
    "shipped": (0.5, 0.5, 0.9), "shipped_m2t95": (0.5, 0.5, 0.95), "shipped_m2t80": (0.5, 0.5, 0.8),
    "shipped_m2t70": (0.5, 0.5, 0.7), "ge": (0.49, 0.49, 0.9), "ge_m2t95": (0.49, 0.49, 0.95),
    "ge_m2t80": (0.49, 0.49, 0.8), "ge_m2t70": (0.49, 0.49, 0.7), "paper_b4": (0.10, 0.25, 0.95),
    "add1_semi3": (0.24, 0.5, 0.9), "add1": (0.24, 0.24, 0.9), "add1_m2t95": (0.24, 0.24, 0.95),
    "commit_all": (0.01, 0.01, 0.01),  # every masked position's top-1 at once: the schedule's TPF ceiling
}
DIAGNOSE = (SINGLEBD, "shipped", "shipped_m2t95", "ge", "ge_m2t80", "paper_b4", "add1")
KINDS = ("forced", "fork", "ref_off")
END = "\0"  # the end of text, as `multibd_diagnosis.first_wrong` marks it
TAU_HI = 0.9  # the confident region of the calibration tables: the shipped tau_m2t
BANDS = (0.5, 0.8, 0.9, 0.99, 0.999, 1.0)  # confidence bands (low, high] of the error table: the top bin split


def config(name: str) -> DecodeConfig:
    """A point's decode settings: the shipped YAMLs with the point's thresholds, so that nothing else differs."""
    if name == SINGLEBD:
        return load_decode(resolve_path("configs/decode/tiny_singlebd.yaml"))[0]
    if name == SINGLEBD_M2T95:
        return validate(DecodeConfig, {**config(SINGLEBD).model_dump(), "tau_m2t": 0.95}, name)
    base = load_decode(resolve_path("configs/decode/tiny_multibd.yaml"))[0]
    add, semi, m2t = POINTS[name]
    return validate(DecodeConfig, {**base.model_dump(), "tau_add": add, "tau_semi": semi, "tau_m2t": m2t}, name)


def frontier(model: Path, run: Path, n: int) -> tuple[dict[str, dict], dict[str, dict]]:
    """Engine outcomes of every point, and per point its accuracy, TPF and difference to SingleBD."""
    recs = {name: decode_one(model, name, n, run / "decoded" / f"{name}.{n}.json", config(name))
            for name in (SINGLEBD, SINGLEBD_M2T95, *POINTS)}
    single = recs[SINGLEBD]
    rows = {}
    for name, r in recs.items():
        k = sum(r["correct"])
        lo, hi = wilson(k, n)
        row = {"thresholds": POINTS.get(name), "accuracy": 100 * k / n, "wilson95": [100 * lo, 100 * hi],
               "tpf": tpf([r]), "tpf_ratio": tpf([r]) / tpf([single])}
        if name != SINGLEBD:
            row["vs_singlebd"] = paired_difference(single["correct"], r["correct"]).model_dump()
        if name in POINTS and POINTS[name][2] == config(SINGLEBD_M2T95).tau_m2t:  # also against SingleBD at the same tau_m2t
            row["vs_singlebd_m2t95"] = paired_difference(recs[SINGLEBD_M2T95]["correct"], r["correct"]).model_dump()
        rows[name] = row
    return recs, rows


def first_wrong_summary(model: Path, name: str, recs: dict[str, dict], records: list[dict], out: Path) -> dict:
    """`multibd_diagnosis.attribute` on the problems SingleBD (same weights) solves and `name` fails."""
    if out.is_file():
        return json.loads(out.read_text())
    lost = [r for r, a, b in zip(records, recs[SINGLEBD]["correct"], recs[name]["correct"]) if a and not b]
    att = attribute(model, config(name), lost)
    first = att["first_wrong"]
    res = {"lost": len(lost), "attributed": len(first), "table": table(first, att["base_rate"]),
           "first_wrong": [{k: f[k] for k in ("rule", "slot", "masks_before", "prev_filled", "own_filled", "conf",
                                               "prev_filled_at_activation")} for f in first],
           "fills_by_rule": {r: sum(v for k, v in att["base_rate"].items() if k.split("|")[0] == r) for r in RULES}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    return res


def attribution_row(s: dict) -> dict:
    """Shares (%) of the first wrong tokens by rule, slot and masks before, and their mean confidence."""
    first, n = s["first_wrong"], max(s["attributed"], 1)

    def shares(key: str, values: tuple) -> list[float]:
        c = Counter(f[key] for f in first)
        return [100 * c.get(v, 0) / n for v in values]

    fills = sum(s["fills_by_rule"].values()) or 1
    return {"lost": s["lost"], "attributed": s["attributed"], "rule": shares("rule", RULES),
            "rule_all_fills": [100 * s["fills_by_rule"].get(r, 0) / fills for r in RULES],
            "slot": shares("slot", (0, 1, 2, 3)), "masks_before": shares("masks_before", (0, 1, 2, 3)),
            "conf": float(np.mean([f["conf"] for f in first])) if first else None}


def next_chars(valid_end: set[str], prefix: str) -> set[str]:
    """The characters (END included) that continue `prefix` towards some valid solution + END."""
    k = len(prefix)
    return {v[k] for v in valid_end if len(v) > k and v.startswith(prefix)}


def label_decode(preds: list[dict], prompt_len: int, ref_ids: list[int], ref_eos: bool, ref_text: str,
                 valid: set[str], decode_char: dict[int, str]) -> list[tuple]:
    """The scored predictions of one decode, as rows (conf, agree, valid, kind, rule, slot, own, prev, masks
    before, off): right = SingleBD's token, scored up to the forward that first commits another (module doc)."""
    if len(ref_text) != len(ref_ids):
        raise ValueError("the calibration needs a one-character-per-token tokenizer (the tiny task's)")
    valid_end = {v + END for v in valid}
    ends = len(ref_ids) + (1 if ref_eos else 0)
    scored = []
    for p in preds:
        k = p["pos"] - prompt_len
        if not 0 <= k < ends:
            continue
        want = ref_text[k] if k < len(ref_ids) else END
        got = decode_char.get(p["token"], "?")
        options = next_chars(valid_end, ref_text[:k])
        kind = 0 if len(options) == 1 else (1 if options else 2)
        scored.append((p, got == want, got in options, kind))
    cut = min((p["step"] for p, agree, _, _ in scored if p["rule"] and not agree), default=None)
    rule = {None: 0, **{r: i + 1 for i, r in enumerate(RULES)}}
    return [(p["conf"], agree, ok, kind, rule[p["rule"]], p["slot"], p["own_filled"], p["prev_filled"],
             p["masks_before"], bool(p["rule"]) and not agree and p["step"] == cut)
            for p, agree, ok, kind in scored if cut is None or p["step"] <= cut]


COLUMNS = ("conf", "agree", "valid", "kind", "rule", "slot", "own", "prev", "masks_before", "off")


def calibration_pass(model: Path, name: str, records: list[dict], single: dict, out: Path) -> dict[str, np.ndarray]:
    """Every scored prediction of the naive decodes of `records` at `name` (kept in `out`, an .npz)."""
    if out.is_file():
        with np.load(out) as z:
            return dict(z)
    from mbd.decoding.spec import load_engine_model
    from mbd.multitf.records import load_tokenizer

    weights, _ = load_engine_model(model, EngineConfig(device="cpu", dtype="float32", threads=1))
    tok, mcfg = load_tokenizer(str(model))
    stops = set(tok.stop_token_ids)
    decode_char = {t: (END if t in stops else tok.decode([t])) for t in range(mcfg.vocab_size)}
    ref = RecordingNaive(weights, config(name), tok.stop_token_ids)
    rows, problem, equal = [], [], []
    for i, r in enumerate(records):
        prompt = prompt_ids(r, tok, mcfg.block_size)
        ref.reset()
        res = ref.generate(prompt)
        equal.append(res.token_ids == single["token_ids"][i])
        got = label_decode(ref.predictions, len(prompt), single["token_ids"][i], single["finish"][i] == "eos",
                           single["text"][i], valid_solutions(r["fields"]), decode_char)
        rows += got
        problem += [i] * len(got)
    cols = {c: np.array([row[j] for row in rows]) for j, c in enumerate(COLUMNS)}
    cols["problem"], cols["equal_to_singlebd"] = np.array(problem), np.array(equal)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **cols)
    print(f"    calibration {name}: {len(rows)} scored predictions", flush=True)
    return cols


def summary(conf: np.ndarray, agree: np.ndarray) -> dict | None:
    """n, mean confidence, agreement with SingleBD (%), ECE, and how the wrong ones split at TAU_HI: in the
    confident region the errors observed against those its confidence predicts (sum of 1 - conf), the region a
    10-bin ECE lumps into one bin."""
    if conf.size == 0:
        return None
    r = reliability(conf, agree)
    hi, wrong = conf > TAU_HI, ~agree
    return {"n": r.n, "conf": 100 * r.confidence, "agree": 100 * r.accuracy, "ece": 100 * r.ece,
            "share_hi": 100 * float(hi.mean()), "errors_hi": int((wrong & hi).sum()),
            "expected_errors_hi": float((1 - conf[hi]).sum()),
            "agree_hi": 100 * float(agree[hi].mean()) if hi.any() else None,
            "agree_lo": 100 * float(agree[~hi].mean()) if (~hi).any() else None,
            "wrong_hi": 100 * float((wrong & hi).sum() / wrong.sum()) if wrong.any() else None}


def state_groups(c: dict[str, np.ndarray], block: int = 4) -> dict[str, np.ndarray]:
    """Block state at the forward: own block fresh (no token yet) or partly filled; context clean (no mask in
    an earlier resident block), predecessor partly filled, or masks only further back."""
    fresh, clean, prev_partial = c["own"] == 0, c["masks_before"] == 0, c["prev"] < block
    return {"fresh, clean context": fresh & clean, "partly filled, clean context": ~fresh & clean,
            "fresh, predecessor partly filled": fresh & prev_partial,
            "partly filled, predecessor partly filled": ~fresh & prev_partial,
            "masks further back only": ~clean & ~prev_partial}


def bands(conf: np.ndarray, agree: np.ndarray) -> list[dict]:
    """Per confidence band of BANDS: predictions, errors observed and errors expected (sum of 1 - conf)."""
    out = []
    for lo, hi in zip(BANDS, BANDS[1:]):
        sel = (conf > lo) & (conf <= hi)
        out.append({"low": lo, "high": hi, "n": int(sel.sum()), "errors": int((sel & ~agree).sum()),
                    "expected": float((1 - conf[sel]).sum())})
    return out


def calibration_report(c: dict[str, np.ndarray]) -> dict:
    """Summaries of the forced positions (all predictions, committed ones) by state, slot, masks before and
    rule; the fork positions; the first off-SingleBD commits; reliability curves."""
    forced, committed = c["kind"] == 0, c["rule"] > 0
    conf, agree = c["conf"], c["agree"].astype(bool)
    groups = {"all": np.ones_like(forced), **{f"state: {k}": v for k, v in state_groups(c).items()},
              **{f"slot {s}": c["slot"] == s for s in range(4)},
              **{f"masks before {m}": c["masks_before"] == m for m in range(4)}}
    out: dict = {"predictions": {}, "committed": {}}
    for name, sel in groups.items():
        out["predictions"][name] = summary(conf[sel & forced], agree[sel & forced])
        out["committed"][name] = summary(conf[sel & forced & committed], agree[sel & forced & committed])
    for i, rule in enumerate(RULES, 1):
        out["committed"][f"rule: {rule}"] = summary(conf[forced & (c["rule"] == i)], agree[forced & (c["rule"] == i)])
    fork = c["kind"] == 1
    out["fork"] = {"predictions": summary(conf[fork], agree[fork]),
                   "committed": summary(conf[fork & committed], agree[fork & committed])}
    off = c["off"].astype(bool)
    out["off"] = {"commits": int(off.sum()), "decodes": int(np.unique(c["problem"][off]).size),
                  "by_kind": {k: int((off & (c["kind"] == i)).sum()) for i, k in enumerate(KINDS)},
                  "valid": int((off & c["valid"].astype(bool)).sum()),
                  "forced_by_rule": {r: int((off & forced & (c["rule"] == i)).sum()) for i, r in enumerate(RULES, 1)},
                  "forced_conf": float(conf[off & forced].mean()) if (off & forced).any() else None}
    out["equal_to_singlebd"] = float(c["equal_to_singlebd"].mean())
    out["bands"] = {k: bands(conf[sel & forced], agree[sel & forced]) for k, sel in state_groups(c).items()}
    out["reliability"] = {k: reliability(conf[sel], agree[sel]).model_dump()
                          for k, sel in (("predictions", forced), ("committed", forced & committed)) if sel.any()}
    return out


def _pct(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _diff(d: dict | None) -> str:
    return "-" if d is None else (f"{d['diff_pp']:+.2f} [{d['ci_low_pp']:+.2f}, {d['ci_high_pp']:+.2f}] "
                                  f"({d['only_a']} / {d['only_b']})")


def print_frontier(rows: dict[str, dict]) -> None:
    print("\n| point | tau_add / tau_semi / tau_m2t | Acc % [95% Wilson] | TPF | x SingleBD | "
          "- SingleBD pp [95% CI] (only S / only M) | - SingleBD at tau_m2t 0.95 |\n|:---|:---|---:|---:|---:|:---|:---|")
    for name, r in sorted(rows.items(), key=lambda kv: kv[1]["tpf"]):
        th = " / ".join(f"{t:g}" for t in r["thresholds"]) if r["thresholds"] else \
            f"SingleBD, tau_m2t {config(name).tau_m2t:g}"
        diff = _diff(r.get("vs_singlebd")) if name != SINGLEBD else "reference"
        print(f"| {name} | {th} | {r['accuracy']:.1f} [{r['wilson95'][0]:.1f}, {r['wilson95'][1]:.1f}] | "
              f"{r['tpf']:.2f} | {r['tpf_ratio']:.2f}x | {diff} | {_diff(r.get('vs_singlebd_m2t95'))} |")


def print_attribution(att: dict[str, dict], rows: dict[str, dict]) -> None:
    print("\nfirst wrong tokens (problems SingleBD solves and the point fails; share %, all fills in brackets)")
    print("| point | x SingleBD | lost / attributed | M2T | fallback first | fallback semi | slot 0/1/2/3 | "
          "masks before 0/1/2/3+ | mean conf |\n|:---|---:|---:|---:|---:|---:|:---|:---|---:|")
    for name, s in att.items():
        a = attribution_row(s)
        rule = " | ".join(f"{v:.0f} ({w:.0f})" for v, w in zip(a["rule"], a["rule_all_fills"]))
        print(f"| {name} | {rows[name]['tpf_ratio']:.2f}x | {a['lost']} / {a['attributed']} | {rule} | "
              f"{' / '.join(f'{v:.0f}' for v in a['slot'])} | {' / '.join(f'{v:.0f}' for v in a['masks_before'])} "
              f"| {_pct(a['conf'], '{:.2f}')} |")


def print_calibration(cal: dict[str, dict]) -> None:
    head = ("| point | group | n | mean conf % | agree % | ECE % | conf > 0.9: share % / agree % | errors at conf > "
            "0.9: observed / expected | conf <= 0.9: agree % | wrong with conf > 0.9 % |\n"
            "|:---|:---|---:|---:|---:|---:|:---|:---|---:|---:|")
    for pop in ("committed", "predictions"):
        print(f"\ncalibration, forced positions, {pop} (right = SingleBD's token)\n{head}")
        for name, c in cal.items():
            for group, s in c[pop].items():
                if s is not None:
                    print(f"| {name} | {group} | {s['n']} | {s['conf']:.1f} | {s['agree']:.2f} | {s['ece']:.2f} | "
                          f"{s['share_hi']:.0f} / {_pct(s['agree_hi'], '{:.2f}')} | {s['errors_hi']} / "
                          f"{s['expected_errors_hi']:.1f} | {_pct(s['agree_lo'])} | "
                          f"{_pct(s['wrong_hi'], '{:.0f}')} |")
    print("\nfork positions, first off-SingleBD commits, decodes equal to SingleBD's")
    for name, c in cal.items():
        f, o = c["fork"], c["off"]
        fork = ", ".join(f"{k} n {v['n']} conf {v['conf']:.1f} agree {v['agree']:.1f}"
                         for k, v in f.items() if v is not None)
        print(f"  {name}: equal {100 * c['equal_to_singlebd']:.1f}%; forks: {fork}; off commits {o['commits']} in "
              f"{o['decodes']} decodes, by kind {o['by_kind']}, valid {o['valid']}, forced by rule "
              f"{o['forced_by_rule']}, forced mean conf {_pct(o['forced_conf'], '{:.3f}')}")
    print("\nerrors by confidence band, forced positions, all predictions: observed / expected (n)")
    print("| point | state | " + " | ".join(f"({lo:g}, {hi:g}]" for lo, hi in zip(BANDS, BANDS[1:])) + " |\n|:---|:---|"
          + "---:|" * (len(BANDS) - 1))
    for name, c in cal.items():
        for state, rows in c["bands"].items():
            if any(b["n"] for b in rows):
                print(f"| {name} | {state} | " + " | ".join(f"{b['errors']} / {b['expected']:.1f} ({b['n']})"
                                                          for b in rows) + " |")
    print("\nreliability curves, forced positions (bin low: n, conf %, agree %)")
    for name, c in cal.items():
        for pop, r in c["reliability"].items():
            bins = "; ".join(f"{b['low']:.1f}: {b['n']}, {100 * b['confidence']:.0f}, {100 * b['accuracy']:.1f}"
                             for b in r["bins"])
            print(f"  {name} {pop} (ECE {100 * r['ece']:.2f}%): {bins}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mbd/assets/mbd-tiny", help="the MBD-tiny model directory")
    ap.add_argument("--problems", type=int, default=1000, help="first N dev problems")
    ap.add_argument("--diagnose", nargs="*", default=list(DIAGNOSE), help="points of the naive passes (2, 3)")
    ap.add_argument("--run-dir", default="runs/frontier")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    unknown = set(args.diagnose) - {SINGLEBD, *POINTS}
    if unknown:
        raise SystemExit(f"unknown points {sorted(unknown)}; known: {SINGLEBD}, {', '.join(POINTS)}")
    model, run, n = resolve_path(args.model), Path(args.run_dir).resolve(), args.problems
    recs, rows = frontier(model, run, n)
    print_frontier(rows)
    records = generate("dev", n, 0)  # the tinymath-dev benchmark's problems, in its order
    att = {name: first_wrong_summary(model, name, recs, records, run / "attribution" / f"{name}.{n}.json")
           for name in args.diagnose if name != SINGLEBD}
    print_attribution(att, rows)
    cal = {name: calibration_report(calibration_pass(model, name, records, recs[SINGLEBD],
                                                     run / "calibration" / f"{name}.{n}.npz"))
           for name in args.diagnose}
    print_calibration(cal)
    for name, s in att.items():
        print(f"\n[{name}] first wrong tokens in detail (multibd_diagnosis.table)\n{s['table']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"problems": n, "benchmark": "tinymath-dev", "frontier": rows,
                                               "attribution": {k: attribution_row(v) for k, v in att.items()},
                                               "calibration": cal}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
