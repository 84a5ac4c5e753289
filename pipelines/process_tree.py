"""Ending the processes a command (or a test's cluster) started, and only those, by pid: Ray's agents can
outlive their raylet, and other users' Ray processes on the same machine must never be touched."""

from __future__ import annotations

import psutil

__all__ = ["descendants", "end_processes", "still_running"]


def descendants(pids: list[int]) -> list[psutil.Process]:
    """The live processes among `pids` and all their descendants (take it before the parents end: orphans are
    re-parented and no longer found)."""
    out: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                out[p.pid] = p
        except psutil.NoSuchProcess:
            continue
    return list(out.values())


def end_processes(procs: list[psutil.Process], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL what is still alive after `grace_s`: exactly these processes."""
    procs = [p for p in procs if p.is_running()]
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def still_running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `procs` that still run (zombies, ended but not yet reaped, do not count)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out
