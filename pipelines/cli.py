"""The `mbd` command. Each subcommand lives in its own module exposing `main(argv) -> int`; modules are
imported only when their subcommand runs, so `mbd --help` is instant and needs no Ray."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "quickstart": ("pipelines.quickstart",
                   "run the whole pipeline on the embedded tiny model (expand, train, eval, serve)"),
    "reproduce": ("pipelines.reproduce", "small-scale reproduction of the paper's claims on the tiny model"),
    "expand": ("pipelines.expand_layouts", "Ray Data: expand a corpus into MultiTF group-layouts (Parquet)"),
    "train": ("pipelines.train_multitf", "Ray Train + DeepSpeed: MultiTF post-training from a YAML config"),
    "pretrain-tiny": ("pipelines.pretrain_tiny", "train the embedded tiny BD-LM from scratch (block-diffusion TF)"),
    "export": ("pipelines.export", "export a training checkpoint to a HuggingFace safetensors directory"),
    "generate": ("pipelines.generate", "decode prompts with SingleBD / MultiBD (Block Buffer engine)"),
    "serve": ("pipelines.serve", "start the OpenAI-compatible Ray Serve application"),
    "warmup": ("pipelines.warmup", "compile a serve config's decode shapes into a compile cache ahead of serving"),
    "eval": ("pipelines.eval_sweep", "evaluation sweep: models x decoding configs x benchmarks"),
    "plan": ("pipelines.plan", "per-rank memory plan of a serve or train config (weights, KV pool, ZeRO states)"),
    "forward": ("pipelines.forward", "one forward pass of a model directory (smoke test)"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = ["usage: mbd <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in SUBCOMMANDS.items()]
    lines += ["", "Run `mbd <command> --help` for the options of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"mbd: unknown command '{name}'\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
