"""MultiBD's speedup over SingleBD where users meet it, over HTTP (issue 64): the same weights served at both decode
points, requests/s and output tokens/s at 1, 8, 32 and 64 closed-loop streaming chat clients.

One local Ray cluster (Ray Serve's high-throughput mode, as `mbd serve` starts it) runs the app of --config
(default configs/serve/tiny.yaml) twice, from the same --model (default: the config's, MBD-tiny): under route
/singlebd with `decode.base` = configs/decode/tiny_singlebd.yaml and under /multibd with
configs/decode/tiny_multibd.yaml; everything else (engine, batch rows, limits) is the serve config's. Both apps stay
up and only one is loaded at a time, so that the two points' runs alternate seconds apart without a redeploy
between them (starting a cluster per run would cost more than the runs and put a cold service into every one).
What the idle app costs meanwhile (its replicas' and engine process's health checks, metrics pushes and idle
ticks) is measured and printed, in CPU cores: it is the same for both points. Both apps share HAProxy, the Serve
controller and the GCS, as two models of one deployment would.

Each run sends the first --requests held-out tinymath problems (zero-shot chat, as the evaluation sends them, the
same for both points) from `clients` closed-loop streaming clients, with max_tokens --max-tokens and natural EOS
(not ignore_eos: how many steps a request takes is the decode point's to decide). A round runs every level at both
points, ABAB; each round flips the order of the points and of the levels, so that a change in the machine's load
lands on every level and point alike. Per level and point, medians over --rounds of: requests/s, output tokens/s,
TPF (as the service reports it); ratios (MBD / SingleBD at a level, a point's requests/s from one level to the
next) are medians of per-round ratios, with their range. Where the time goes, per run: the engine's busy share
(its decode steps' wall time over the run's), decoding rows per step, a step's wall time, "engine-only"
requests/s (requests over the decode steps' time: what the service would give if nothing but the engine's steps
took time) and the CPU milliseconds per request of the client (this process), HAProxy, the ingress replica, the
decoder replica and its engine process; requests per CPU-second of all of them is what a CPU-bound machine would
serve, and depends less than requests/s on what else the machine runs. The machine's 1-minute load average is
printed beside each level (this machine may be shared). Loopback only.

    python -m benchmarks.http_speedup                                   # 256 requests a run, 3 rounds
    python -m benchmarks.http_speedup --requests 8 --rounds 1 --levels 1 2   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import psutil

from actors.tp_worker import free_port
from benchmarks.serve_breakdown import cpu_ms_per_request, cpu_s
from benchmarks.serve_load import heldout_messages, run_http_stream
from mbd.eval.report import markdown_table
from pipelines.ray_session import init_ray
from serve_app.config import ServeConfig, load_serve_config

REPO = Path(__file__).resolve().parents[1]
POINTS = {"SingleBD": REPO / "configs/decode/tiny_singlebd.yaml", "MultiBD": REPO / "configs/decode/tiny_multibd.yaml"}
PARTS = ("client", "proxy", "OpenAIIngress", "Decoder", "engine")  # CPU per request, in the request's order
REPLICAS = ("OpenAIIngress", "Decoder", "engine")  # an app's own processes (the proxy is shared)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "serve" / "tiny.yaml"))
    p.add_argument("--model", help="model directory served at both points (default: the config's model.path)")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 64], help="closed-loop clients per level")
    p.add_argument("--requests", type=int, default=256, help="requests per run (every level, point and round)")
    p.add_argument("--rounds", type=int, default=3, help="runs per level and point, alternated ABAB")
    p.add_argument("--max-tokens", type=int, default=128, help="the evaluation's max_new_tokens for tinymath")
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance")
    return p.parse_args(argv)


def point_configs(args: argparse.Namespace) -> dict[str, ServeConfig]:
    """The serve config at each decode point, over the same model."""
    sets = [f"model.path={args.model}"] if args.model else []
    cfgs = {name: load_serve_config(args.config, sets + [f"decode.base={base}"]) for name, base in POINTS.items()}
    path = cfgs["SingleBD"].model.resolved_path()
    if not (path / "config.json").is_file():
        raise SystemExit(f"no model at {path}: pass --model DIR")
    return cfgs


class App:
    """One served decode point: its URL, its engine's counters and its processes' CPU seconds."""

    def __init__(self, name: str, cfg: ServeConfig, port: int):
        from ray import serve

        self.name, self.model = name.lower(), cfg.model.name
        self.url = f"http://127.0.0.1:{port}/{self.name}/v1/chat/completions"
        handle = serve.get_deployment_handle("Decoder", app_name=self.name)
        self.engine: Callable[[], dict] = lambda: handle.stats.remote().result()

    def run(self, messages: list[list[dict]], clients: int, max_tokens: int, idle: App) -> dict:
        """One closed-loop run against this app while `idle` waits; its numbers and where its time went."""
        me = psutil.Process()
        e0, c0, i0, m0 = self.engine(), cpu_s(self.name), cpu_s(idle.name), sum(me.cpu_times()[:2])
        out = asyncio.run(run_http_stream(self.url, self.model, messages, clients, max_tokens, ignore_eos=False))
        e1, c1, i1, m1 = self.engine(), cpu_s(self.name), cpu_s(idle.name), sum(me.cpu_times()[:2])
        n, wall = out["requests"], out["requests"] / out["req_per_s"]
        step_s, steps = e1["step_s"] - e0["step_s"], e1["steps"] - e0["steps"]
        cpu = cpu_ms_per_request(c0, c1, n) | {"client": 1e3 * (m1 - m0) / n}
        idle_ms = sum(cpu_ms_per_request({k: i0[k] for k in REPLICAS}, {k: i1[k] for k in REPLICAS}, 1).values())
        return out | {"engine_busy": step_s / wall, "rows_per_step": (e1["decode_rows"] - e0["decode_rows"]) / steps,
                      "step_ms": 1e3 * step_s / steps, "engine_req_per_s": n / step_s, "cpu_ms_per_request": cpu,
                      "req_per_cpu_s": 1e3 / sum(cpu.values()), "idle_app_cores": idle_ms / 1e3 / wall}


def run_rounds(args: argparse.Namespace, cfgs: dict[str, ServeConfig]) -> dict[int, dict]:
    """`--rounds` rounds, each a run of every level at both points (the points' order and the levels' order flipped
    every round), so that a change in the machine's load lands on every level alike; per level, its runs and the
    load average before each."""
    import ray
    from ray import serve

    from serve_app.app import build_app

    messages = heldout_messages(args.requests)
    init_ray(num_cpus=args.cpus, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    results: dict[int, dict] = {c: {"runs": {name: [] for name in cfgs}, "load": []} for c in args.levels}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for name, cfg in cfgs.items():
            serve.run(build_app({"serve_config": cfg}), name=name.lower(), route_prefix=f"/{name.lower()}")
        apps = {name: App(name, cfg, port) for name, cfg in cfgs.items()}
        other = {name: next(a for n, a in apps.items() if n != name) for name in apps}
        for name, app in apps.items():  # warm-up: first-call costs land in no run
            app.run(messages[:4], 2, args.max_tokens, other[name])
        for rnd in range(args.rounds):
            order = 1 if rnd % 2 == 0 else -1
            for c in args.levels[::order]:
                for name in list(apps)[::order]:
                    results[c]["load"].append(os.getloadavg()[0])
                    results[c]["runs"][name].append(apps[name].run(messages, c, args.max_tokens, other[name]))
            print(f"# round {rnd + 1} of {args.rounds} done ({time.strftime('%H:%M:%S')}, load "
                  f"{os.getloadavg()[0]:.1f})", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return results


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def paired(over: list[dict], under: list[dict], key: str) -> list[float]:
    """`key` of `over` over that of `under`, round by round."""
    return [a[key] / b[key] for a, b in zip(over, under)]


def spread(per: list[float]) -> str:
    """The median of per-round ratios, and their range."""
    return f"{statistics.median(per):.2f}x ({min(per):.2f}-{max(per):.2f})"


def ratio(results: dict, key: str) -> str:
    """MBD / SingleBD of `key` at one level: the median of the per-round ratios, and their range."""
    return spread(paired(results["runs"]["MultiBD"], results["runs"]["SingleBD"], key))


def report(args: argparse.Namespace, cfgs: dict[str, ServeConfig], results: dict[int, dict]) -> None:
    """The throughput table, where the time went, the issue's two targets, and every run as one JSON line."""
    cfg = cfgs["MultiBD"]
    print(f"\nmodel {cfg.model.resolved_path()} at both points, max_batch_rows {cfg.engine.max_batch_rows}, "
          f"{args.requests} requests a run, max_tokens {args.max_tokens} (natural EOS), streaming chat, "
          f"{args.rounds} rounds alternated ABAB, medians; load = 1-minute load average before the level's runs "
          f"({os.cpu_count()} CPUs)\n")
    rows = []
    for c, r in results.items():
        s, m = r["runs"]["SingleBD"], r["runs"]["MultiBD"]
        rows.append([str(c), f"{min(r['load']):.1f}-{max(r['load']):.1f}", f"{median(s, 'req_per_s'):.1f}",
                     f"{median(m, 'req_per_s'):.1f}", f"**{ratio(r, 'req_per_s')}**", f"{median(s, 'tok_per_s'):.0f}",
                     f"{median(m, 'tok_per_s'):.0f}", ratio(r, "tok_per_s"),
                     f"{median(s, 'tpf'):.2f} / {median(m, 'tpf'):.2f}", ratio(r, "engine_req_per_s"),
                     ratio(r, "req_per_cpu_s")])
    print(markdown_table(["clients", "load", "SingleBD req/s", "MultiBD req/s", "req/s MBD / SingleBD",
                          "SingleBD tok/s", "MultiBD tok/s", "tok/s MBD / SingleBD", "TPF S / M",
                          "engine-only req/s MBD / SingleBD", "requests per CPU-second MBD / SingleBD"], rows))
    rows = []
    for c, r in results.items():
        for name, runs in r["runs"].items():
            cpu = [statistics.median(x["cpu_ms_per_request"][k] for x in runs) for k in PARTS]
            rows.append([str(c), name, f"{median(runs, 'engine_busy'):.2f}", f"{median(runs, 'rows_per_step'):.2f}",
                         f"{median(runs, 'step_ms'):.2f}", f"{median(runs, 'engine_req_per_s'):.1f}",
                         " / ".join(f"{x:.1f}" for x in cpu), f"{median(runs, 'idle_app_cores'):.3f}"])
    print()
    print(markdown_table(["clients", "point", "engine busy", "decoding rows / step", "ms / step", "engine-only req/s",
                          "CPU ms / request: client / HAProxy / ingress / decoder replica / engine",
                          "idle app's CPU (cores)"], rows))
    levels = list(results)
    for name in POINTS:
        steps = {f"{a} -> {b}": paired(results[b]["runs"][name], results[a]["runs"][name], "req_per_s")
                 for a, b in zip(levels, levels[1:])}
        falls = [k for k, per in steps.items() if statistics.median(per) < 1]
        print(f"{name} requests/s as clients grow (median of per-round ratios): "
              + ", ".join(f"{k} {spread(per)}" for k, per in steps.items())
              + f"; never falling: {'yes' if not falls else 'no (' + ', '.join(falls) + ')'}")
    print(json.dumps({str(c): r for c, r in results.items()}))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfgs = point_configs(args)
    report(args, cfgs, run_rounds(args, cfgs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
