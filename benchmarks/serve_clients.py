"""Our serving numbers next to a benchmark client we did not write (guidellm), on the same server and workload.

Starts `mbd serve --config configs/serve/tiny.yaml` on a loopback port (or uses --url), then for each concurrency
alternates (ABAB, order flipped every round) guidellm's `concurrent` profile and benchmarks/serve_load.py's
streaming client over the same tinymath chat prompts, each request generating exactly --max-tokens tokens
(guidellm sends ignore_eos with max_completion_tokens; ours sends ignore_eos with max_tokens). Medians over
rounds of: TTFT p50, ITL p50 (both clients: (latency - TTFT) / (tokens - 1)), output tokens/s, requests/s.
Only loopback traffic; every loop is bounded by --requests and --rounds.

guidellm is installed apart from the project (its pins would fight ours), e.g.
    python -m venv /tmp/gl && /tmp/gl/bin/pip install guidellm==0.8.1
    python -m benchmarks.serve_clients --guidellm /tmp/gl/bin/guidellm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from actors.tp_worker import free_port
from benchmarks.serve_load import run_http_stream
from mbd.tiny.task import generate as tiny_problems
from serve_app.config import load_serve_config

REPO = Path(__file__).resolve().parents[1]
KEYS = ("ttft_p50_ms", "itl_p50_ms", "tok_per_s", "req_per_s")


def start_server(config: str, port: int, log: Path, timeout_s: float = 300) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "serve", "--config", config, "--port", str(port)],
                            cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mbd serve exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"mbd serve did not become healthy within {timeout_s:.0f}s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)  # mbd serve shuts Serve and Ray down on SIGTERM
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def run_guidellm(exe: str, url: str, tokenizer: Path, data: Path, conc: int, n: int, out: Path) -> dict:
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={url},request_format=/v1/chat/completions",
           "--profile", f"kind=concurrent,streams={conc}", "--constraint", f"kind=max_requests,count={n}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--data", f"kind=json_file,path={data}",
           "--output", f"kind=json,path={out}", "--disable-progress"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    m = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    ok = lambda k, stat="median": m[k]["successful"][stat]  # noqa: E731
    errors = m["request_totals"]["errored"] if isinstance(m["request_totals"], dict) else 0
    if errors:
        raise RuntimeError(f"guidellm: {errors} requests failed")
    return {"ttft_p50_ms": ok("time_to_first_token_ms"), "itl_p50_ms": ok("inter_token_latency_ms"),
            "tok_per_s": ok("output_tokens_per_second", "mean"), "req_per_s": ok("requests_per_second", "mean"),
            "tokens_per_req": ok("output_token_count")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "serve" / "tiny.yaml"))
    p.add_argument("--url", help="an already running server (default: start `mbd serve --config` here)")
    p.add_argument("--guidellm", default="guidellm", help="the guidellm executable")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests", type=int, default=32, help="requests per client run")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)

    cfg = load_serve_config(args.config)
    questions = [r["question"] for r in tiny_problems("heldout", args.requests, seed=0)]
    messages = [[{"role": "user", "content": q}] for q in questions]
    work = Path(tempfile.mkdtemp(prefix="serve_clients_"))
    data = work / "tinymath.jsonl"
    data.write_text("".join(json.dumps({"prompt": q, "output_tokens_count": args.max_tokens}) + "\n"
                            for q in questions))
    proc = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        port = free_port()
        proc = start_server(args.config, port, work / "serve.log")
        url = f"http://127.0.0.1:{port}"
    results: dict[int, dict[str, list[dict]]] = {}
    try:
        asyncio.run(run_http_stream(f"{url}/v1/chat/completions", cfg.model.name, messages[:2], 2, 8))  # warm-up
        for c in args.concurrency:
            runs: dict[str, list[dict]] = {"ours": [], "guidellm": []}
            for r in range(args.rounds):
                order = ("ours", "guidellm") if r % 2 == 0 else ("guidellm", "ours")
                for who in order:
                    if who == "ours":
                        runs[who].append(asyncio.run(run_http_stream(f"{url}/v1/chat/completions", cfg.model.name,
                                                                     messages, c, args.max_tokens)))
                    else:
                        runs[who].append(run_guidellm(args.guidellm, url, cfg.model.resolved_path(), data, c,
                                                      args.requests, work / f"gl_{c}_{r}.json"))
            results[c] = runs
    finally:
        if proc is not None:
            stop_server(proc)

    print(f"model {cfg.model.name}, {args.requests} requests x {args.max_tokens} tokens per run, "
          f"{args.rounds} rounds (ABAB), medians over rounds; chat streaming, ignore_eos")
    print(f"{'clients':>7} {'client':>9} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'out tok/s':>10} {'req/s':>7}")
    table = {}
    for c, runs in results.items():
        for who, rs in runs.items():
            med = {k: statistics.median(x[k] for x in rs) for k in KEYS}
            table[f"{c}/{who}"] = med
            print(f"{c:>7} {who:>9} {med['ttft_p50_ms']:>12.1f} {med['itl_p50_ms']:>11.2f} {med['tok_per_s']:>10.1f} "
                  f"{med['req_per_s']:>7.2f}")
    print(json.dumps({"table": table, "raw": {str(c): r for c, r in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
