"""`mbd generate`: decode prompts with SingleBD / MultiBD through the Block Buffer engine.

    mbd generate --model DIR --config configs/decode/tiny_multibd.yaml "3*4+2*7-5"
    mbd generate --config configs/decode/tiny_singlebd.yaml --prompt-file prompts.txt --json
    mbd generate --config configs/decode/tiny_multibd.yaml --stream "3*4+2*7-5"
    mbd generate --config configs/decode/tiny_multibd.yaml --set engine.attention=flex -v "3*4+2*7-5"

A prompt file holds one prompt per line (`.jsonl`: one {"prompt": ...} object per line). Prompts are
wrapped in the model's chat format unless --raw. Thin on purpose: everything happens in mbd.decoding.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mbd.config import REPO_ROOT, ConfigError, DecodeConfig, load_decode
from mbd.training_record import multibd_warning

__all__ = ["load_decode_config", "main"]  # what other pipelines may use

MBD_TINY_DIR = REPO_ROOT / "mbd" / "assets" / "mbd-tiny"  # the embedded MBD model (its base: mbd/assets/tiny)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise ConfigError(f"--prompt-file {path}: no such file")
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        if path.suffix == ".jsonl":
            for i, ln in enumerate(lines):
                row = json.loads(ln)
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                    raise ConfigError(f"{path}:{i + 1}: expected a JSON object with a string field 'prompt'")
                prompts.append(row["prompt"])
        else:
            prompts += lines
    if not prompts:
        raise ConfigError("no prompt given: pass prompts as arguments or use --prompt-file")
    return prompts


def load_decode_config(path: str | Path) -> DecodeConfig:
    """The decoding parameters of a decode YAML (`mbd.config.load_decode`), without its `engine:` section."""
    return load_decode(path)[0]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mbd generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompts", nargs="*", help="prompt texts")
    ap.add_argument("--model", default=None, help=f"checkpoint directory or Hugging Face Hub id ORG/NAME[@REVISION] "
                    f"(default: the embedded MBD model {MBD_TINY_DIR.relative_to(REPO_ROOT)})")
    ap.add_argument("--config", required=True, help="decode config YAML, e.g. configs/decode/tiny_multibd.yaml")
    ap.add_argument("--prompt-file", help="one prompt per line, or .jsonl with a 'prompt' field")
    ap.add_argument("--raw", action="store_true", help="do not wrap prompts in the chat format")
    ap.add_argument("--stream", action="store_true", help="print text as blocks commit (one prompt)")
    ap.add_argument("--json", action="store_true", help="one JSON result per line")
    ap.add_argument("--trace", action="store_true", help="include per-step slot states in --json output")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field: --set tau_add=0.2, --set engine.attention=flex")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the engine configuration first")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from mbd.decoding import build_engine  # after argument parsing: `--help` stays instant
    from mbd.hub import resolve_model  # huggingface_hub too

    try:
        cfg, engine_cfg = load_decode(args.config, args.sets)
        if args.trace:
            engine_cfg = engine_cfg.model_copy(update={"trace": True})
        prompts = read_prompts(args)
        model_dir = resolve_model(args.model) if args.model else MBD_TINY_DIR
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"--model {model_dir}: not a checkpoint directory (config.json missing)")
        if warning := multibd_warning(model_dir, args.model or str(model_dir), cfg.buffer_size):
            print(f"mbd generate: warning: {warning}", file=sys.stderr, flush=True)
        if args.verbose:
            print(f"mbd generate: {engine_cfg.summary()}", file=sys.stderr, flush=True)
        engine = build_engine(model_dir, cfg, engine_cfg)
        if engine.tokenizer is None:
            raise ConfigError(f"--model {model_dir}: tokenizer.json missing; text prompts need a tokenizer")
    except (ConfigError, ValueError) as e:
        print(f"mbd generate: {e}", file=sys.stderr)
        return 2
    if args.stream:
        if len(prompts) != 1:
            print("mbd generate: --stream takes exactly one prompt", file=sys.stderr)
            return 2
        for delta in engine.stream(prompts[0], chat=not args.raw):
            print(delta, end="", flush=True)
        print()
        return 0
    for prompt, res in zip(prompts, engine.generate(prompts, chat=not args.raw)):
        if args.json:
            print(json.dumps({"prompt": prompt, **res.model_dump(exclude=None if args.trace else {"trace"})}))
        else:
            print(f"### {prompt}\n{res.text}\n[{res.finish_reason}] tokens={res.num_generated} nfe={res.nfe} "
                  f"tpf={res.tpf:.2f} wall={res.wall_time_s:.2f}s step={res.step_latency_ms:.2f}ms\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
