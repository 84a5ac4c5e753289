"""`mbd warmup --config configs/serve/<cfg>.yaml --cache DIR`: build a serve config's compile cache ahead of time.

Why: a replica compiles (and on a GPU captures) every decode shape at start-up; cold that is minutes, from a
filled cache seconds. This command compiles every shape of the config's engine (`decode_shapes` of its batch
buckets and N_buf) into DIR, a line per shape and the total at the end, so a replica started with that cache
(`mbd serve --cache DIR`, or `engine.compile_cache`) is ready quickly. DIR is a portable artefact: it is keyed by
torch version, device and a hash of the compiled config (`mbd.decoding.compiled.keyed_cache`), so a replica on
another node with another torch, GPU or model never reads kernels built for a different one.

The kernels do not depend on the weights' values: the model is built from the checkpoint's config.json with
random weights on the engine's device, so the checkpoint's weights are not read.
"""

from __future__ import annotations

import argparse
import logging
import sys

from mbd.config import ConfigError


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mbd warmup", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="a configs/serve/*.yaml file")
    p.add_argument("--cache", help="the compile cache folder (default: the config's engine.compile_cache)")
    p.add_argument("--model", "--model-path", dest="model_path", help="override model.path")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set engine.batch_buckets=[1,8]")
    return p.parse_args(argv)


def warm(config: str, cache: str | None, model_path: str | None, sets: list[str]) -> float:
    """Compile the config's decode shapes into the cache; the seconds it took."""
    from mbd.decoding import Engine
    from mbd.decoding.compiled import decode_mode
    from mbd.checkpoint_files import read_model_config
    from mbd.model.checkpoint import build_model
    from serve_app.config import load_serve_config

    cfg = load_serve_config(config, sets)
    engine = cfg.engine.model_copy(update={"compile_cache": cache or cfg.engine.compile_cache})
    if not engine.compile_cache:
        raise ConfigError("no compile cache: pass --cache DIR or set engine.compile_cache")
    if cfg.model.tensor_parallel_size > 1:
        raise ConfigError(f"model.tensor_parallel_size {cfg.model.tensor_parallel_size}: mbd warmup compiles one "
                          "rank in one process (tensor_parallel_size 1); a TP replica fills the cache on its "
                          "first start")
    if not decode_mode(engine, engine.torch_device()).static:
        raise ConfigError("engine.attention / compile / cuda_graphs: this engine runs eager on its device, "
                          "nothing to compile (set attention: flex and compile: default)")
    path = cfg.model.resolved_path() if not model_path else cfg.model.model_copy(
        update={"path": model_path}).resolved_path()
    model = build_model(read_model_config(path)).to(engine.torch_device(), engine.torch_dtype())
    return Engine(model, None, cfg.decode, engine).warmup_s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not logging.getLogger().handlers:  # the engine's warm-up lines (a line per shape) on stderr
        logging.basicConfig(format="%(message)s")
    logging.getLogger("mbd.engine").setLevel(logging.INFO)
    try:
        seconds = warm(args.config, args.cache, args.model_path, args.sets)
    except ConfigError as e:
        print(f"mbd warmup: {e}", file=sys.stderr)
        return 2
    print(f"mbd warmup: compile cache ready in {seconds:.1f} s")
    return 0
