"""OpenAI-compatible Ray Serve application: a FastAPI ingress in front of autoscaled decoder replicas.

- `OpenAIIngress` (serve_app/ingress.py; CPU, cheap) validates and tokenizes requests, detokenizes committed
  blocks into text, applies stop strings and speaks HTTP/SSE. Nothing malformed gets past it.
- `Decoder` (serve_app/decoder_replica.py) is the host of a Block Buffer engine process (actors/engine_host.py):
  one replica = one placement group = tensor_parallel_size ranks. It streams each request's committed blocks back
  to the ingress as the engine's `StepOutput`s.

Splitting them lets GPU replicas scale on `target_ongoing_requests` while HTTP stays on CPU, and lets the
decoder's `max_queued_requests` back-pressure surface as a clean 503 with Retry-After.
`serve run serve_app.app:build_app config=configs/serve/tiny.yaml` or `mbd serve --config ...` (pipelines/serve.py).
"""

from __future__ import annotations

from typing import Any

from ray import serve

from serve_app.config import load_serve_config
from serve_app.decoder_replica import Decoder
from serve_app.ingress import OpenAIIngress

# Ray Serve's documented switches (its performance guide): a replica runs our handlers, and routes its calls to
# the decoder, on its main event loop instead of two extra threads. Our handlers never block their loop (big
# (de)tokenization runs in a pool; the engine runs in a process of its own, read by one thread), and each request
# would otherwise cross threads, and contend for the GIL, several times per hop.
ONE_LOOP = {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                         "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}}


def build_app(args: dict[str, Any]) -> serve.Application:
    """`serve run serve_app.app:build_app config=PATH`: the whole application from one serve YAML
    (args may also carry a ready ServeConfig under 'serve_config', as `mbd serve` and the tests do)."""
    cfg = args.get("serve_config")
    if cfg is None:
        if "config" not in args:
            raise ValueError("build_app needs args 'config': path to a configs/serve/*.yaml file")
        cfg = load_serve_config(args["config"])
    spec = cfg.model.model_copy(update={"path": str(cfg.model.resolved_path())})
    cfg = cfg.model_copy(update={"model": spec})
    for f in ("config.json", "tokenizer.json"):
        if not (spec.resolved_path() / f).is_file():
            raise FileNotFoundError(f"model.path: {spec.path} has no {f} (expected a HuggingFace-format model dir)")
    dec = cfg.decoder
    rank_res = {"CPU": spec.num_cpus_per_rank} | ({"GPU": spec.num_gpus_per_rank} if spec.num_gpus_per_rank else {})
    decoder = Decoder.options(
        ray_actor_options={"num_cpus": spec.num_cpus_per_rank, "num_gpus": spec.num_gpus_per_rank,
                           "runtime_env": ONE_LOOP},
        placement_group_bundles=[rank_res] * spec.tensor_parallel_size,
        placement_group_strategy="STRICT_PACK",
        max_ongoing_requests=dec.max_ongoing_requests,
        max_queued_requests=dec.max_queued_requests,
        backpressure_config={"retry_after_s": dec.retry_after_s},
        autoscaling_config=dec.autoscaling.model_dump() | {"initial_replicas": max(1, dec.autoscaling.min_replicas)},
        health_check_period_s=dec.health_check_period_s,
        health_check_timeout_s=dec.health_check_timeout_s,
        logging_config={"enable_access_log": False},  # an internal hop: the ingress logs the HTTP request
    ).bind(spec, cfg.decode, cfg.engine, dec.engine_restarts)
    ing = cfg.ingress
    return OpenAIIngress.options(
        num_replicas=ing.num_replicas, max_ongoing_requests=ing.max_ongoing_requests,
        ray_actor_options={"num_cpus": ing.num_cpus, "runtime_env": ONE_LOOP},
    ).bind(decoder, cfg)
