"""Run untrusted (model-generated) Python in a locked-down child process.

Why a child process with layered guards: generated code may loop forever, allocate without bound,
fork, open sockets or write anywhere. Each run gets
- a wall deadline enforced by the parent, which then kills the child's whole process group;
- rlimits: CPU seconds, address space (memory), process count (RLIMIT_NPROC; the kernel does not
  apply it to root, so the audit hook below is the process guard there), file size, no core dumps;
- a new network namespace (`unshare -n`, or `unshare -rn` for non-root) when the host allows one;
- a Python audit hook installed before the code runs that refuses process creation (fork, exec,
  spawn, subprocess), signals to other processes, sockets, ctypes symbol lookup, rlimit changes and
  any write, rename or delete outside the run's fresh temporary directory.
The audit hook lives inside the untrusted interpreter, so it stops accidents and ordinary code,
not a determined attacker; the kernel-side layers (rlimits, netns, killpg) are the backstop.

This file is stdlib-only on purpose: the child runs this very file as its entry point
(`python -I -B code_exec.py job.json`), so it must import nothing from the repository.
Values cross the process boundary as type-tagged JSON (`encode_value`/`decode_value`): the parent
never unpickles anything the child produced.
"""

from __future__ import annotations

import copy
import json
import math
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Collection, Literal, Sequence

Status = Literal["passed", "failed", "timeout", "error"]

_JOB_FILE = "job.json"
_STDERR_FILE = "stderr.txt"
_STDOUT_FILE = "stdout.txt"
_TAIL_CHARS = 4000


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one sandboxed run."""

    wall_s: float = 10.0
    cpu_s: float | None = None  # CPU-time budget (RLIMIT_CPU); None: the same as wall_s
    memory_bytes: int = 4 << 30  # address space; EvalPlus uses 4 GiB as well
    nproc: int = 32  # RLIMIT_NPROC (per user, threads included; not enforced for root)
    file_size_bytes: int = 64 << 20


@dataclass(frozen=True)
class ExecResult:
    """Outcome of a run.

    `run_program`: passed = exit status 0. `run_calls`: passed = every input produced a CallOutput
    and the callback never asked to stop (correctness of the values is the caller's business).
    """

    status: Status
    detail: str
    stdout: str = ""


@dataclass(frozen=True)
class CallOutput:
    """What one call `fn(*inputs[index])` did inside the sandbox."""

    index: int
    value: Any = None
    elapsed_s: float = 0.0
    error: str | None = None  # "ExcType: message" when the call raised
    timed_out: bool = False  # the per-input time limit fired
    too_large: bool = False  # the value had more than `max_items` elements, so it was not sent
    matches_reference: bool | None = None  # for reference_indices: `value == reference(*input)` in the child


class Opaque:
    """Stand-in for a value the codec cannot carry (a regex match, a generator, a custom object).

    It is not None and equals nothing but itself, which is exactly what EvalPlus's not-None oracle
    and plain `==` comparisons need from such values.
    """

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"Opaque({self.type_name})"


# ---------------------------------------------------------------------------------------------
# value codec: JSON with tags for the types JSON cannot tell apart
# ---------------------------------------------------------------------------------------------

_INT_JSON_MAX = 1 << 62  # larger ints travel as hex: str(int) is capped at 4300 digits in 3.11+


class ValueTooLarge(ValueError):
    """The value has more elements than the encoding budget allows."""


def encode_value(x: Any, max_items: int | None = None) -> Any:
    """Encode a Python value as JSON-able data; every JSON object in the result is a tag.

    With `max_items`, raise ValueTooLarge once more than that many values have been visited, so a
    gigantic output costs a bounded amount of work.
    """
    budget = [max_items if max_items is not None else -1]
    return _encode(x, budget)


def _encode(x: Any, budget: list[int]) -> Any:
    if budget[0] >= 0:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueTooLarge()
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if isinstance(x, int) and t.__module__ != "numpy":
        x = int(x)
        return x if -_INT_JSON_MAX < x < _INT_JSON_MAX else {"$i": hex(x)}
    if isinstance(x, float) and t.__module__ != "numpy":
        return float(x)  # json writes NaN/Infinity and reads them back
    if isinstance(x, str):
        return str(x)
    if isinstance(x, complex) and t.__module__ != "numpy":
        return {"$c": [x.real, x.imag]}
    if isinstance(x, list):
        return [_encode(v, budget) for v in x]
    if isinstance(x, tuple):
        return {"$t": [_encode(v, budget) for v in x]}
    if isinstance(x, frozenset):
        return {"$fs": [_encode(v, budget) for v in x]}
    if isinstance(x, set):
        return {"$s": [_encode(v, budget) for v in x]}
    if isinstance(x, dict):
        return {"$d": [[_encode(k, budget), _encode(v, budget)] for k, v in x.items()]}
    if isinstance(x, (bytes, bytearray)):
        return {"$b": bytes(x).hex()}
    if t.__module__ == "numpy" and hasattr(x, "dtype") and x.dtype.kind in "biufc":
        if hasattr(x, "shape") and x.shape != ():
            return {"$nd": [x.dtype.str, list(x.shape), _encode(x.tolist(), budget)]}
        return {"$np": [x.dtype.str, _encode(x.item(), budget)]}
    return {"$o": t.__name__}


def decode_value(obj: Any) -> Any:
    """Inverse of `encode_value` (numpy values need numpy in the decoding process)."""
    if isinstance(obj, list):
        return [decode_value(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    (tag, payload), = obj.items()
    if tag == "$t":
        return tuple(decode_value(v) for v in payload)
    if tag == "$s":
        return {decode_value(v) for v in payload}
    if tag == "$fs":
        return frozenset(decode_value(v) for v in payload)
    if tag == "$d":
        return {decode_value(k): decode_value(v) for k, v in payload}
    if tag == "$i":
        return int(payload, 16)
    if tag == "$c":
        return complex(payload[0], payload[1])
    if tag == "$b":
        return bytes.fromhex(payload)
    if tag == "$o":
        return Opaque(payload)
    import numpy as np

    if tag == "$np":
        return np.dtype(payload[0]).type(decode_value(payload[1]))
    if tag == "$nd":
        return np.array(decode_value(payload[2]), dtype=np.dtype(payload[0])).reshape(payload[1])
    raise ValueError(f"unknown value tag {tag!r}")


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def network_namespace_prefix() -> tuple[str, ...]:
    """The `unshare` command that gives the child an empty network namespace here, or () if none."""
    if shutil.which("unshare") is None:
        return ()
    for prefix in (("unshare", "-n"), ("unshare", "-r", "-n")):
        try:
            ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return prefix
    return ()


def run_program(source: str, limits: SandboxLimits = SandboxLimits()) -> ExecResult:
    """Run `source` as a script (`__name__ == "__main__"`); passed iff it exits with status 0."""
    return _run({"mode": "program", "source": source}, limits, None)


def run_calls(
    source: str,
    entry_point: str,
    inputs: Sequence[Sequence[Any]],
    time_limits: Sequence[float],
    on_output: Callable[[CallOutput], bool],
    limits: SandboxLimits = SandboxLimits(),
    max_items: int | None = None,
    reference_source: str | None = None,
    reference_indices: Collection[int] = (),
) -> ExecResult:
    """Define `source`, then call `entry_point(*inputs[i])` for each i in ONE sandboxed process.

    Each call has its own limit of `time_limits[i]` CPU seconds (ITIMER_PROF, so a loaded machine
    does not fail a fast program; a sleeping one is caught by the wall deadline), and reports its
    CPU time as `elapsed_s`. Results stream back as they are
    produced and are handed to `on_output`; returning False stops the run at once (fast fail).
    Values with more than `max_items` elements are not sent back (`too_large`). For the inputs in
    `reference_indices`, `reference_source` (trusted) computes the expected value inside the child
    first and only the verdict `value == expected` comes back: outputs too large to ship
    are compared where they live.
    """
    if len(inputs) != len(time_limits):
        raise ValueError(f"time_limits has {len(time_limits)} entries for {len(inputs)} inputs")
    if reference_indices and reference_source is None:
        raise ValueError("reference_indices needs reference_source")
    job = {"mode": "calls", "source": source, "entry_point": entry_point,
           "inputs": [encode_value(list(a)) for a in inputs], "time_limits": [float(t) for t in time_limits],
           "max_items": max_items, "reference_source": reference_source,
           "reference_indices": sorted(reference_indices)}
    expected = len(inputs)
    seen = 0
    load_error: list[str] = []

    def on_line(msg: dict) -> bool:
        nonlocal seen
        if "load_error" in msg:
            load_error.append(msg["load_error"])
            return False
        seen += 1
        out = CallOutput(index=msg["i"], elapsed_s=msg.get("t", 0.0), error=msg.get("err"),
                         timed_out=bool(msg.get("timeout")), too_large=bool(msg.get("big")),
                         matches_reference=msg.get("same"),
                         value=decode_value(msg["v"]) if "v" in msg else None)
        return on_output(out)

    result = _run(job, limits, on_line)
    if load_error:
        return ExecResult("failed", f"program failed to load: {load_error[0]}")
    if result.status == "passed" and seen < expected:
        return ExecResult("failed", f"stopped after {seen}/{expected} inputs")
    return result


def _run(job: dict, limits: SandboxLimits, on_line: Callable[[dict], bool] | None) -> ExecResult:
    workdir = tempfile.mkdtemp(prefix="mbd-sandbox-")
    try:
        cpu_s = limits.wall_s if limits.cpu_s is None else limits.cpu_s
        job["limits"] = {"cpu_s": math.ceil(cpu_s), "memory_bytes": limits.memory_bytes, "nproc": limits.nproc,
                         "file_size_bytes": limits.file_size_bytes, "parent_pid": os.getpid()}
        with open(os.path.join(workdir, _JOB_FILE), "w") as f:
            json.dump(job, f)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        cmd = [*network_namespace_prefix(), sys.executable, "-I", "-B", os.path.abspath(__file__),
               os.path.join(workdir, _JOB_FILE)]
        with open(os.path.join(workdir, _STDERR_FILE), "wb") as err:
            try:
                proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=err, start_new_session=True, close_fds=True)
            except OSError as e:
                return ExecResult("error", f"could not start the sandbox: {e}")
            timed_out, stopped = _pump(proc, time.monotonic() + limits.wall_s, on_line)
        return _verdict(proc.returncode, timed_out, stopped, workdir, limits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _pump(proc: subprocess.Popen, deadline: float, on_line: Callable[[dict], bool] | None) -> tuple[bool, bool]:
    """Read result lines until EOF, the deadline or a stop request; always kill the process group."""
    timed_out = stopped = False
    fd = proc.stdout.fileno()
    buf = bytearray()
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while not stopped:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                if not sel.select(remaining):
                    continue
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                buf += chunk
                while not stopped and (nl := buf.find(b"\n")) >= 0:
                    line = bytes(buf[:nl])
                    del buf[: nl + 1]
                    stopped = on_line is not None and not on_line(json.loads(line))
        if not (timed_out or stopped):
            timed_out = not _wait_unreaped(proc, deadline)
    finally:
        # Kill the whole group while the leader is still unreaped, so its id cannot have been reused.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        proc.stdout.close()
    return timed_out, stopped


def _wait_unreaped(proc: subprocess.Popen, deadline: float) -> bool:
    """Wait (without reaping, where the OS allows) until `proc` exits; False if the deadline passes first."""
    while True:
        if hasattr(os, "waitid"):
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        elif proc.poll() is not None:  # no waitid (macOS): this reaps, leaving a tiny pid-reuse window
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)


def _verdict(code: int, timed_out: bool, stopped: bool, workdir: str, limits: SandboxLimits) -> ExecResult:
    stdout = _tail(os.path.join(workdir, _STDOUT_FILE))
    if timed_out:
        return ExecResult("timeout", f"wall time limit of {limits.wall_s:g}s exceeded; process group killed", stdout)
    if stopped:
        return ExecResult("failed", "stopped by the caller", stdout)
    if code == 0:
        return ExecResult("passed", "exit status 0", stdout)
    if code < 0:
        sig = signal.Signals(-code)
        if sig == signal.SIGXCPU:
            return ExecResult("timeout", "CPU time limit exceeded (SIGXCPU)", stdout)
        return ExecResult("failed", f"killed by {sig.name}", stdout)
    lines = [ln for ln in _tail(os.path.join(workdir, _STDERR_FILE)).splitlines() if ln.strip()]
    return ExecResult("failed", lines[-1] if lines else f"exit status {code}", stdout)


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _TAIL_CHARS))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------
# child side (runs in the sandboxed interpreter)
# ---------------------------------------------------------------------------------------------

# Audit events refused outright: process creation, signalling, networking, ctypes symbol lookup
# (the route to raw libc calls), and changing rlimits (root could raise the hard ones).
_BLOCKED_PREFIXES = ("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
                     "subprocess.", "os.kill", "os.killpg", "signal.pthread_kill", "socket.", "ctypes.dl",
                     "resource.setrlimit", "resource.prlimit", "os.startfile", "webbrowser.")
# Events whose path arguments must stay inside the sandbox directory, with the positions of their
# dir_fd arguments (a dir_fd makes a relative path resolve elsewhere, so any dir_fd is refused).
_PATH_EVENTS = {"os.remove": (1,), "os.rename": (2, 3), "os.rmdir": (1,), "os.mkdir": (2,), "os.chmod": (2,),
                "os.chown": (3,), "os.link": (2, 3), "os.symlink": (2,), "os.truncate": (), "os.utime": (3,),
                "os.chflags": (), "os.lchflags": (), "os.mkfifo": (2,), "os.mknod": (3,), "shutil.rmtree": (1,),
                "shutil.move": (), "shutil.copyfile": (), "shutil.copymode": (), "shutil.copystat": (),
                "shutil.chown": ()}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_ALWAYS_WRITABLE = ("/dev/null",)
_PR_SET_PDEATHSIG = 1


class _InputTimeout(BaseException):
    """Raised by the per-input CPU timer; a BaseException so `except Exception` in user code cannot eat it."""


def _make_audit_hook(root: str) -> Callable[[str, tuple], None]:
    prefix = root.rstrip(os.sep) + os.sep

    def inside(p: Any) -> bool:
        if isinstance(p, int):  # an already-open file descriptor
            return True
        real = os.path.realpath(os.fsdecode(p))
        return real == root or real.startswith(prefix) or real in _ALWAYS_WRITABLE

    def hook(event: str, args: tuple) -> None:
        if event.startswith(_BLOCKED_PREFIXES):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] == "_posixsubprocess":
            raise PermissionError("sandbox: re-importing _posixsubprocess is not allowed")
        if event == "open":
            path, mode, flags = args
            if path is None or inside(path):
                return
            if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & _WRITE_FLAGS:
                raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory is not allowed")
            if os.path.isdir(os.fsdecode(path)):  # a directory fd would let dir_fd calls escape
                raise PermissionError(f"sandbox: opening directory {path!r} is not allowed")
        elif event in _PATH_EVENTS:
            if any(i < len(args) and args[i] is not None for i in _PATH_EVENTS[event]):
                raise PermissionError(f"sandbox: {event} with dir_fd is not allowed")
            for a in args:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                    raise PermissionError(f"sandbox: {event} on {a!r} outside the sandbox directory is not allowed")

    return hook


def _blocked(*_args: Any, **_kwargs: Any) -> None:
    raise PermissionError("sandbox: process creation is not allowed")


def _lock_down(root: str, lim: dict) -> int:
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
    out = os.open(os.path.join(root, _STDOUT_FILE), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.close(out)
    # ctypes dlopens the main program at import; load it now so a later `import ctypes` (numpy does
    # one) still works while new symbol lookups are refused.
    import _posixsubprocess
    import ctypes

    if sys.platform.startswith("linux"):  # die with the parent: it is the one enforcing the wall deadline
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != lim["parent_pid"]:
            os._exit(1)
    _posixsubprocess.fork_exec = _blocked
    subprocess._fork_exec = _blocked
    sys.addaudithook(_make_audit_hook(root))
    return result_fd


def _emit(fd: int, msg: dict) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _on_cpu_limit(_signum: int, _frame: Any) -> None:
    raise _InputTimeout()


def _child_main(job_path: str) -> None:
    root = os.path.dirname(os.path.realpath(job_path))
    with open(job_path) as f:
        job = json.load(f)
    os.chdir(root)
    result_fd = _lock_down(root, job["limits"])
    if job["mode"] == "program":
        exec(compile(job["source"], "<candidate>", "exec"), {"__name__": "__main__"})
        return
    try:
        reference = _load(job["reference_source"], job["entry_point"]) if job["reference_source"] else None
        fn = _load(job["source"], job["entry_point"])
    except BaseException as e:  # noqa: BLE001 - anything the candidate raises is a load failure
        detail = f"entry point {job['entry_point']!r} is not defined" if isinstance(e, KeyError) else _describe(e)
        _emit(result_fd, {"load_error": detail})
        os._exit(0)
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
        _emit(result_fd, msg)
    os._exit(0)  # skip interpreter teardown: candidate threads or atexit hooks must not hang the run


def _load(source: str, entry_point: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {"__name__": "__candidate__"}
    exec(compile(source, "<candidate>", "exec"), namespace)
    return namespace[entry_point]


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


if __name__ == "__main__":
    _child_main(sys.argv[1])
