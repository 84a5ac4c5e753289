"""What structured output costs: TPF, TPS and the grammar matcher's share of step time, with and without a
constraint, side by side in one run (rounds alternate unconstrained / constrained, medians over rounds).

1. tiny: the embedded tiny model on `tinymath` held-out problems (SingleBD and MultiBD configs), constrained by a
   regex of its answer format; exact-match accuracy beside the unconstrained run.
2. json: 200 requests over the five JSON schemas of the tests (tests/unit/structured_helpers.py) on a random-weight
   model with a byte-level BPE tokenizer built here; every constrained output is checked with jsonschema.

    python benchmarks/structured_output.py --rounds 3 --problems 200
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbd.config import DecodeConfig, EngineConfig  # noqa: E402
from mbd.decoding import Engine, build_engine  # noqa: E402
from mbd.decoding.constraints import ConstraintSpec  # noqa: E402
from pipelines.generate import load_decode_config  # noqa: E402

TINY_REGEX = r"([0-9]{1,3}[*+-][0-9]{1,3}=[0-9]{1,3};){4}#### [0-9]{1,3}"


def run(engine: Engine, prompts: list, constraints: list | None, chat: bool = True) -> tuple[list, dict[str, float]]:
    """Decode `prompts`; (results, TPF / TPS / matcher share) of this run alone."""
    s0 = (engine.stats.step_s, engine.stats.grammar_s)
    t0 = time.perf_counter()
    res = engine.generate(prompts, constraints=constraints, chat=chat)
    wall = time.perf_counter() - t0
    step, grammar = engine.stats.step_s - s0[0], engine.stats.grammar_s - s0[1]
    gen, nfe = sum(r.num_generated for r in res), sum(r.nfe for r in res)
    return res, {"tpf": gen / max(nfe, 1), "tps": gen / wall, "share": grammar / step if step else 0.0}


def tiny(rounds: int, n: int) -> None:
    from mbd.tiny.benchmark import TinyMath

    bench = TinyMath()
    problems = bench.load(limit=n)
    prompts = [p.prompt_text for p in problems]
    spec = ConstraintSpec("regex", TINY_REGEX, "regex")
    print(f"tiny model, {n} held-out tinymath problems, regex {TINY_REGEX}")
    print(f"{'config':10} {'run':13} {'accuracy':>8} {'TPF':>6} {'TPS':>7} {'matcher share':>13}")
    for name in ("tiny_singlebd", "tiny_multibd"):
        cfg = load_decode_config(ROOT / "configs" / "decode" / f"{name}.yaml")
        engine = build_engine("mbd/assets/tiny", cfg, EngineConfig(device="cpu", max_batch_rows=16))
        rows: dict[str, list[dict[str, float]]] = {"unconstrained": [], "constrained": []}
        for r in range(rounds):
            order = ["unconstrained", "constrained"] if r % 2 == 0 else ["constrained", "unconstrained"]
            for kind in order:
                res, m = run(engine, prompts, [spec] * n if kind == "constrained" else None)
                m["accuracy"] = sum(bench.score(p, x.text).correct for p, x in zip(problems, res)) / n
                rows[kind].append(m)
        for kind, ms in rows.items():
            med = {k: statistics.median(m[k] for m in ms) for k in ms[0]}
            print(f"{name:10} {kind:13} {med['accuracy']:8.3f} {med['tpf']:6.2f} {med['tps']:7.1f} "
                  f"{med['share']:13.1%}")


def json_schemas(rounds: int) -> None:
    import jsonschema

    from mbd.model import build_model
    from mbd.tokenizer import Tokenizer
    from tests.conftest import tiny_cfg
    from tests.unit.structured_helpers import SCHEMAS, build_bpe

    cfg = tiny_cfg(vocab_size=416, mask_token_id=3, eos_token_id=0, pad_token_id=0, max_position_embeddings=512)
    model = build_model(cfg, seed=0).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    tok = Tokenizer(build_bpe(), "sdar", 3, 0, 0)
    rng = random.Random(0)
    jobs = [(name, [rng.randrange(4, 400) for _ in range(rng.randrange(3, 24))]) for name in SCHEMAS for _ in range(40)]
    specs = [ConstraintSpec.json_schema(SCHEMAS[name]) for name, _ in jobs]
    print(f"\nrandom-weight model, byte-level BPE (416 ids), {len(jobs)} requests over {len(SCHEMAS)} JSON schemas")
    print(f"{'config':10} {'run':13} {'valid':>8} {'TPF':>6} {'TPS':>7} {'matcher share':>13}")
    for name, kw in (("singlebd", dict(buffer_size=1, tau_add=None)), ("multibd", dict(buffer_size=3, tau_add=0.25))):
        dc = DecodeConfig(max_length=320, max_new_tokens=120, max_nfe=300, tau_semi=0.5, tau_m2t=0.2, **kw)
        engine = Engine(model, tok, dc, EngineConfig(max_batch_rows=32))
        rows: dict[str, list[dict[str, float]]] = {"unconstrained": [], "constrained": []}
        for r in range(rounds):
            for kind in (["unconstrained", "constrained"] if r % 2 == 0 else ["constrained", "unconstrained"]):
                res, m = run(engine, [p for _, p in jobs], specs if kind == "constrained" else None, chat=False)
                m["valid"] = sum(_valid(x.text, SCHEMAS[n], jsonschema) for (n, _), x in zip(jobs, res)) / len(jobs)
                rows[kind].append(m)
        for kind, ms in rows.items():
            med = {k: statistics.median(m[k] for m in ms) for k in ms[0]}
            print(f"{name:10} {kind:13} {med['valid']:8.3f} {med['tpf']:6.2f} {med['tps']:7.1f} {med['share']:13.1%}")


def _valid(text: str, schema: dict, jsonschema) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--parts", default="tiny,json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if "tiny" in args.parts:
        tiny(args.rounds, args.problems)
    if "json" in args.parts:
        json_schemas(args.rounds)


if __name__ == "__main__":
    main()
