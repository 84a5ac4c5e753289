"""Cost of building the Group-Aware Dual-Stream Mask: FlexAttention BlockMask (mask_mod) vs dense [2L, 2L].

Each measurement runs in a fresh subprocess. Memory: `first_MB` is the growth of the process's peak RSS
(ru_maxrss) during the first call (it includes torch.compile's own cost for the compiled variant);
`steady_MB` is the peak RSS growth during a later call, sampled from /proc/self/statm every 0.5 ms.
The children run with MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors go back to the OS at once and
the sampled RSS follows the live allocations; times are measured in separate children with the default
allocator.
Time is the median of `--repeats` calls after the first one. Ratios (dense / BlockMask) are measured in the
same invocation, because this machine is shared and absolute times drift.

    python -m benchmarks.multitf_masks                     # 2L = 4096 and 8192, B = 32, batch 1
    python -m benchmarks.multitf_masks --compile           # also create_block_mask(_compile=True)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import os
import statistics
import threading
import time

import numpy as np
import torch

from mbd.multitf.layouts import first_response_block, random_layout
from mbd.multitf.masks import DualStreamIndex


def make_index(two_l: int, block_size: int, batch: int, gmax: int) -> DualStreamIndex:
    rng = np.random.default_rng(0)
    k = two_l // 2 // block_size
    prompt_len = k * block_size // 4 + 3
    bg = np.stack([random_layout(k, first_response_block(prompt_len, block_size), gmax, rng) for _ in range(batch)])
    return DualStreamIndex.build(bg, [k * block_size - 5] * batch, block_size)


def nbytes(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    return sum(t.numel() * t.element_size() for t in obj.as_tuple() if torch.is_tensor(t))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def steady_peak_mb(fn) -> float:
    """Peak RSS growth while `fn` runs, sampled by a background thread (torch releases the GIL)."""
    base, peak, done = rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.0005)

    th = threading.Thread(target=sample)
    th.start()
    result = fn()
    peak[0] = max(peak[0], rss_bytes())
    done.set()
    th.join()
    del result
    return (peak[0] - base) / 2**20


def measure(method: str, memory: bool, two_l: int, block_size: int, batch: int, gmax: int, repeats: int,
            out: mp.Queue) -> None:
    torch.set_num_threads(1)
    idx = make_index(two_l, block_size, batch, gmax)
    build = {
        "dense": idx.dense_mask,
        "block_mask": lambda: idx.block_mask(),
        "block_mask_compiled": lambda: idx.block_mask(compile=True),
    }[method]
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = build()  # first call (compiles the compiled variant)
    first_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_kb) / 1024
    size = nbytes(result)
    del result
    if memory:
        out.put(dict(first_mb=first_mb, steady_mb=steady_peak_mb(build), out_mb=size / 2**20))
        return
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        build()
        times.append(time.perf_counter() - t0)
    out.put(dict(time_s=statistics.median(times)))


def run(method: str, **kw) -> dict:
    """Time in one child (default allocator), memory in another (mmap threshold, see module doc)."""
    res = {}
    ctx = mp.get_context("spawn")
    for memory in (False, True):
        if memory:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned child only
        q = ctx.Queue()
        p = ctx.Process(target=measure, kwargs=dict(method=method, memory=memory, out=q, **kw))
        p.start()
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        res.update(q.get())
        p.join()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192], help="2L values")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gmax", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time create_block_mask(_compile=True)")
    args = ap.parse_args()
    methods = ["dense", "block_mask"] + (["block_mask_compiled"] if args.compile else [])
    print(f"torch {torch.__version__}, B={args.block_size}, batch={args.batch}, gmax={args.gmax}, 1 thread")
    print(f"{'2L':>6} {'method':>20} {'time_ms':>9} {'first_MB':>9} {'steady_MB':>10} {'result_MB':>10}")
    for two_l in args.lengths:
        res = {m: run(m, two_l=two_l, block_size=args.block_size, batch=args.batch, gmax=args.gmax,
                      repeats=args.repeats) for m in methods}
        for m, r in res.items():
            print(f"{two_l:>6} {m:>20} {1e3 * r['time_s']:>9.1f} {r['first_mb']:>9.1f} {r['steady_mb']:>10.1f} "
                  f"{r['out_mb']:>10.3f}")
        d = res["dense"]
        for m in methods[1:]:
            f = res[m]
            print(f"{two_l:>6} {'dense / ' + m:>28}: time {d['time_s'] / f['time_s']:.2f}x, steady peak "
                  f"{d['steady_mb'] / max(f['steady_mb'], 1e-3):.2f}x, result size {d['out_mb'] / f['out_mb']:.0f}x")

if __name__ == "__main__":
    main()
