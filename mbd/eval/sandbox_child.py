"""The sandboxed child's runtime: runs as `python -I -B sandbox_child.py` inside the sandbox (`code_exec`).

It reads one job line from stdin (with the run's secret), locks itself down (rlimits, stdout detached from the
result stream, a Python audit hook refusing process creation, signals, sockets, ctypes symbol lookup, rlimit
changes, chdir and writes outside its working directory), then runs the program, or calls its entry point on
each input, or serves `check()`'s calls one stdin line at a time, and writes each result as a JSON line that
carries the secret.

Stdlib-only on purpose: the sandbox's view holds the interpreter and this file with the value codec beside it,
never the repository, so it imports nothing from the project's packages; the codec is loaded by path.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
import time
from typing import Any, Callable


def _load_codec():
    spec = importlib.util.spec_from_file_location(
        "value_codec", os.path.join(os.path.dirname(os.path.abspath(__file__)), "value_codec.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_codec = _load_codec()
encode_value, decode_value, ValueTooLarge = _codec.encode_value, _codec.decode_value, _codec.ValueTooLarge

# Audit events refused outright: process creation, signalling, networking, ctypes symbol lookup
# (the route to raw libc calls), changing rlimits (root could raise the hard ones), and changing the
# working directory (another thread's chdir would make the path checks below resolve against the wrong
# directory), and walking every object or frame of the interpreter (where the runner keeps its secret).
_BLOCKED_PREFIXES = ("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
                     "subprocess.", "os.kill", "os.killpg", "signal.pthread_kill", "socket.", "ctypes.dl",
                     "resource.setrlimit", "resource.prlimit", "os.startfile", "webbrowser.", "os.chdir",
                     "os.fchdir", "os.chroot", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
                     "sys._current_frames")
# Events with path arguments that must stay inside the working directory: (path index, dir_fd index or
# None) per path. A dir_fd is resolved through /proc/self/fd, so temp-file libraries work inside.
_PATH_EVENTS: dict[str, tuple[tuple[int, int | None], ...]] = {
    "os.remove": ((0, 1),), "os.rename": ((0, 2), (1, 3)), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
    "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.link": ((0, 2), (1, 3)), "os.symlink": ((0, None), (1, 2)),
    "os.truncate": ((0, None),), "os.utime": ((0, 3),), "os.mkfifo": ((0, 2),), "os.mknod": ((0, 3),),
    "os.chflags": ((0, None),), "os.lchflags": ((0, None),), "shutil.rmtree": ((0, 1),),
    "shutil.move": ((0, None), (1, None)), "shutil.copyfile": ((0, None), (1, None)),
    "shutil.copymode": ((0, None), (1, None)), "shutil.copystat": ((0, None), (1, None)),
    "shutil.chown": ((0, None),)}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_ALWAYS_WRITABLE = ("/dev/null",)
_PR_SET_PDEATHSIG = 1


class _InputTimeout(BaseException):
    """Raised by the per-input CPU timer; a BaseException so `except Exception` in user code cannot eat it."""


def _make_audit_hook(root: str) -> Callable[[str, tuple], None]:
    prefix = root.rstrip(os.sep) + os.sep

    def resolve(p: Any, dir_fd: Any) -> str:
        path = os.fsdecode(p)
        if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):  # -1: no dir_fd
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        return os.path.realpath(path)

    def inside(p: Any, dir_fd: Any = None) -> bool:
        if isinstance(p, int):  # an already-open file descriptor
            return True
        real = resolve(p, dir_fd)
        return real == root or real.startswith(prefix) or real in _ALWAYS_WRITABLE

    def hook(event: str, args: tuple) -> None:
        if event.startswith(_BLOCKED_PREFIXES):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] == "_posixsubprocess":
            raise PermissionError("sandbox: re-importing _posixsubprocess is not allowed")
        if event == "object.__getattr__" and args[1] in ("tb_frame", "gi_frame", "cr_frame", "ag_frame"):
            raise PermissionError(f"sandbox: reading {args[1]} is not allowed")
        if event == "open":
            path, mode, flags = args
            if path is None or inside(path):
                return
            if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & _WRITE_FLAGS:
                raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory is not allowed")
            if os.path.isdir(os.fsdecode(path)):  # a directory fd outside would let dir_fd calls escape
                raise PermissionError(f"sandbox: opening directory {path!r} outside the sandbox is not allowed")
        elif event in _PATH_EVENTS:
            for at, fd_at in _PATH_EVENTS[event]:
                if at >= len(args) or not isinstance(args[at], (str, bytes, os.PathLike)):
                    continue
                dir_fd = args[fd_at] if fd_at is not None and fd_at < len(args) else None
                if not inside(args[at], dir_fd):
                    raise PermissionError(f"sandbox: {event} on {args[at]!r} outside the sandbox directory is not allowed")

    return hook


def _blocked(*_args: Any, **_kwargs: Any) -> None:
    raise PermissionError("sandbox: process creation is not allowed")


def _lock_down(root: str, lim: dict, stdout_fd: int) -> int:
    """Apply rlimits, detach stdio, pre-import what must load before the hook, install the hook.

    Returns a private descriptor for the result stream (the original stdout pipe).
    """
    for res, value in ((resource.RLIMIT_AS, lim["memory_bytes"]), (resource.RLIMIT_CPU, lim["cpu_s"]),
                       (resource.RLIMIT_NPROC, lim["nproc"]), (resource.RLIMIT_FSIZE, lim["file_size_bytes"]),
                       (resource.RLIMIT_CORE, 0)):
        old_hard = resource.getrlimit(res)[1]
        cap = old_hard if old_hard != resource.RLIM_INFINITY else value + 1
        # never above an existing cap; CPU gets SIGXCPU at the soft limit (reported as a timeout) and
        # SIGKILL one second later at the hard limit, in case the program catches SIGXCPU
        hard = min(value + 1, cap) if res == resource.RLIMIT_CPU else min(value, cap)
        resource.setrlimit(res, (min(value, hard), hard))
    result_fd = os.dup(1)
    os.dup2(stdout_fd, 1)
    os.close(stdout_fd)
    # ctypes dlopens the main program at import; load it now so a later `import ctypes` (numpy does
    # one) still works while new symbol lookups are refused.
    import _posixsubprocess
    import ctypes

    if sys.platform.startswith("linux"):  # die with the parent: it is the one enforcing the wall deadline
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if lim["parent_pid"] and os.getppid() != lim["parent_pid"]:
            os._exit(1)
    _posixsubprocess.fork_exec = _blocked
    subprocess._fork_exec = _blocked
    sys.addaudithook(_make_audit_hook(root))
    return result_fd


def _on_cpu_limit(_signum: int, _frame: Any) -> None:
    raise _InputTimeout()


def _child_main() -> None:
    job = json.loads(sys.stdin.buffer.readline())
    secret = job.pop("secret")
    root = os.path.realpath(job["root"] or os.getcwd())
    os.chdir(root)
    if job["mode"] != "serve":  # nothing more arrives on stdin
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    result_fd = _lock_down(root, job["limits"], job["stdout_fd"])

    def emit(msg: dict) -> None:
        data = (json.dumps({**msg, "k": secret}) + "\n").encode()
        while data:
            data = data[os.write(result_fd, data):]

    if job["mode"] == "program":
        exec(compile(job["source"], "<candidate>", "exec"), {"__name__": "__main__"})
        emit({"done": True})
        _exit()
    if job["mode"] == "serve":
        _serve(job, emit)
        _exit()
    try:
        reference = _load(job["reference_source"], job["entry_point"]) if job["reference_source"] else None
        fn = _load(job["source"], job["entry_point"])
    except BaseException as e:  # noqa: BLE001 - anything the candidate raises is a load failure
        detail = f"entry point {job['entry_point']!r} is not defined" if isinstance(e, KeyError) else _describe(e)
        emit({"load_error": detail})
        _exit()
    signal.signal(signal.SIGPROF, _on_cpu_limit)
    inputs = decode_value(job["inputs"])
    compare_here = set(job["reference_indices"])
    for i, (args, limit) in enumerate(zip(inputs, job["time_limits"])):
        msg: dict[str, Any] = {"i": i}
        try:
            expected = reference(*copy.deepcopy(args)) if i in compare_here else None
            start = time.process_time()
            signal.setitimer(signal.ITIMER_PROF, limit)
            try:
                value = fn(*args)
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
            msg["t"] = time.process_time() - start
            # Shipping or comparing the value is not the candidate's time (EvalPlus times the call only).
            if i in compare_here:
                msg["same"] = bool(value == expected)
            else:
                msg["v"] = encode_value(value, job["max_items"])
        except _InputTimeout:
            msg = {"i": i, "timeout": True}
        except ValueTooLarge:
            msg = {"i": i, "t": msg["t"], "big": True}
        except BaseException as e:  # noqa: BLE001 - reported to the parent as this input's failure
            msg = {"i": i, "err": _describe(e)}
        emit(msg)
    _exit()


def _exit() -> None:
    """Skip interpreter teardown (candidate threads or atexit hooks must not hang the run), but keep the
    program's printed output."""
    try:
        sys.stdout.flush()
    finally:
        os._exit(0)


def _serve(job: dict, emit: Callable[[dict], None]) -> None:
    """`run_check`'s child: define the program, then answer one call request per stdin line."""
    namespace: dict[str, Any] = {"__name__": "__candidate__"}
    try:
        exec(compile(job["source"], "<candidate>", "exec"), namespace)
    except BaseException as e:  # noqa: BLE001 - a load failure
        emit({"load_error": _describe(e)})
        return
    names = [n for n in job["names"] if n in namespace]
    emit({"names": [n for n in names if callable(namespace[n]) and not isinstance(namespace[n], type(sys))],
          "modules": {n: namespace[n].__name__ for n in names if isinstance(namespace[n], type(sys))},
          "values": {n: encode_value(namespace[n], 10_000) for n in names
                     if not callable(namespace[n]) and not isinstance(namespace[n], type(sys))}})
    for line in sys.stdin.buffer:
        req = json.loads(line)
        try:
            value = namespace[req["name"]](*decode_value(req["args"]))
            msg = {"v": encode_value(value, job["max_items"])}
        except BaseException as e:  # noqa: BLE001 - the call's failure, reported to check()
            msg = {"err": _describe(e)}
        emit(msg)


def _load(source: str, entry_point: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {"__name__": "__candidate__"}
    exec(compile(source, "<candidate>", "exec"), namespace)
    return namespace[entry_point]


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


if __name__ == "__main__":
    _child_main()
