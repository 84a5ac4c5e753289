"""Per-program cost of kernel isolation: the same small program through `run_program` with bubblewrap, through
the hook-only layers (`--unsafe-code-exec`), and as a bare `python -I -c` subprocess, interleaved (ABC, CBA, ...)
so that load on a shared machine hits every system alike; medians and ratios are printed.

    python -m benchmarks.sandbox_overhead [--runs 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable

from mbd.eval import isolation
from mbd.eval.code_exec import run_program
from mbd.eval.isolation import isolation_available

PROGRAM = "def f(xs):\n    return sorted(xs)[::-1]\nassert f([3, 1, 2]) == [3, 2, 1]\n"


def _bare() -> None:
    subprocess.run([sys.executable, "-I", "-B", "-c", PROGRAM], check=True, capture_output=True)


def _isolated() -> None:
    assert run_program(PROGRAM).status == "passed"


def _hook_only() -> None:
    """The same harness with kernel isolation switched off, as `--unsafe-code-exec` runs where bwrap is absent."""
    saved, env = isolation.bwrap_command, os.environ.get(isolation.UNSAFE_ENV)
    isolation.bwrap_command = lambda tmpfs_bytes: None
    os.environ[isolation.UNSAFE_ENV] = "1"
    try:
        assert run_program(PROGRAM).status == "passed"
    finally:
        isolation.bwrap_command = saved
        if env is None:
            os.environ.pop(isolation.UNSAFE_ENV)
        else:
            os.environ[isolation.UNSAFE_ENV] = env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    if not isolation_available():
        sys.exit("bubblewrap cannot isolate here (not installed or no user namespaces): nothing to compare")
    systems: dict[str, Callable[[], None]] = {"bwrap": _isolated, "hook-only": _hook_only, "bare python": _bare}
    names = list(systems)
    warnings.simplefilter("ignore", RuntimeWarning)  # the hook-only system's 'no kernel isolation' warning
    for fn in systems.values():  # warm-up: page cache, lru_caches
        fn()
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.runs):
        for n in names if i % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            systems[n]()
            times[n].append(time.perf_counter() - t)
    med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    print(f"{args.runs} runs each, interleaved; median wall ms per program")
    print("| system | median ms | vs bare python | vs hook-only |")
    print("|---|---|---|---|")
    for n in names:
        print(f"| {n} | {med[n]:.1f} | {med[n] / med['bare python']:.2f} | {med[n] / med['hook-only']:.2f} |")
    print(f"kernel isolation adds {med['bwrap'] - med['hook-only']:.1f} ms per program over the hook-only harness")


if __name__ == "__main__":
    main()
