"""`mbd plan --config <serve or train config>`: the per-rank memory plan, before anything is loaded.

A serve config (it has `model:` and `decode:`) is planned at tensor-parallel sizes 1 and 2 (one and two GPUs) and
at its own size; a train config (`run:` and `model_path:`) under ZeRO-2 and ZeRO-3 on one and two GPUs and on its
own worker count. The config's own column is marked `*`. Exit status 1 when the config's own column does not fit.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mbd.config import ConfigError, apply_sets, read_yaml, validate
from mbd.plan import GiB, DeviceMemory, Plan, render, serve_plan, train_plan
from mbd.plan_check import device_memory, model_config, serve_shape, train_shape
from mbd.train_config import TrainConfig


def plan_serve(data: dict, model_override: str | None, memory: DeviceMemory | None) -> tuple[list[Plan], list[str], int, str]:
    from mbd.config import DecodeConfig, EngineConfig

    model = dict(data.get("model") or {})
    own_tp, path = int(model.get("tensor_parallel_size", 1)), str(model.get("path", ""))
    spec = validate(EngineConfig, data.get("engine") or {}, "engine")
    decode = validate(DecodeConfig, data.get("decode") or {}, "decode")
    mcfg, source = model_config(path, model_override)
    shape = serve_shape(spec, own_tp)
    memory = memory or device_memory(shape.cuda)
    tps = sorted({1, 2, own_tp}) if shape.cuda else [own_tp]
    plans = [serve_plan(mcfg, decode, serve_shape(spec, tp), memory) for tp in tps]
    labels = [f"{'*' if tp == own_tp else ''}TP={tp}, {tp}x {memory.name}" for tp in tps]
    return plans, labels, tps.index(own_tp), source


def plan_train(data: dict, model_override: str | None, memory: DeviceMemory | None) -> tuple[list[Plan], list[str], int, str]:
    cfg = validate(TrainConfig, data, "train config")
    mcfg, source = model_config(cfg.model_path, model_override)
    memory = memory or device_memory(cfg.use_gpu)
    own = (cfg.deepspeed.zero_stage, cfg.num_workers)
    cells = sorted({(z, w) for z in (2, 3) for w in (1, 2)} | {own})
    plans = [train_plan(mcfg, train_shape(cfg, w, z), memory) for z, w in cells]
    labels = [f"{'*' if (z, w) == own else ''}ZeRO-{z}, {w}x {memory.name}" for z, w in cells]
    return plans, labels, cells.index(own), source


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mbd plan", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a configs/serve/*.yaml or configs/train/*.yaml file")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, e.g. --set engine.max_batch_rows=64")
    ap.add_argument("--model-config", help="a config.json to plan instead of the model directory's")
    ap.add_argument("--device-gib", type=float, help="plan for a device of this many GiB (default: this machine's "
                                                     "GPU, else an 80 GB H100; host memory for CPU configs)")
    args = ap.parse_args(argv)
    try:
        data = apply_sets(read_yaml(args.config), args.overrides)
        memory = DeviceMemory(f"{args.device_gib:g} GiB device", int(args.device_gib * GiB), 3 * GiB // 4) \
            if args.device_gib else None
        if "run" in data and "model_path" in data:
            plans, labels, own, source = plan_train(data, args.model_config, memory)
        elif "model" in data:
            plans, labels, own, source = plan_serve(data, args.model_config, memory)
        else:
            raise ConfigError(f"{args.config}: neither a serve config (model:, decode:) nor a train config "
                              "(run:, model_path:)")
    except ConfigError as e:
        print(f"mbd plan: {e}", file=sys.stderr)
        return 2
    print(f"{args.config}: model shape from {source}")
    print(render(plans, labels, own))
    return 0 if plans[own].fits else 1


if __name__ == "__main__":
    sys.exit(main())
