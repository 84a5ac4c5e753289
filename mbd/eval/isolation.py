"""Kernel isolation for the code sandbox: the bubblewrap (`bwrap`) command, probed once per process, and the
refusal to run model-written code without it unless the user opts out (`MBD_UNSAFE_CODE_EXEC=1`).

The sandboxed interpreter sees a read-only view of only the interpreter's files and the two files the child
runs (`sandbox_child.py` and the `value_codec.py` it loads), never the repository, plus a private size-capped
tmpfs as its working directory. Without bwrap (opted out), the child still gets an empty network namespace
where `unshare` allows one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from functools import lru_cache
from pathlib import Path

UNSAFE_ENV = "MBD_UNSAFE_CODE_EXEC"  # "1": run without kernel isolation (hook-only), the user's explicit choice
SANDBOX_DIR = "/sandbox"  # the private tmpfs inside the bwrap view
CHILD_FILES = ("sandbox_child.py", "value_codec.py")  # what the child runs, bound into its view
HOST_DIR = Path(__file__).resolve().parent  # where CHILD_FILES live on the host
VIEW_DIR = "/opt/mbd-sandbox"  # where they appear inside the bwrap view
_NOBODY = "65534"


class IsolationUnavailable(RuntimeError):
    """Kernel isolation (bubblewrap with user namespaces) cannot run here and the user did not opt out."""


@lru_cache(maxsize=1)
def network_namespace_prefix() -> tuple[str, ...]:
    """The `unshare` command that gives a hook-only child an empty network namespace, or () if none."""
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


def _view_binds() -> list[str]:
    """bwrap arguments for a read-only view of just what the interpreter needs: the system's /usr (and
    the /bin, /lib* links into it), the interpreter's prefixes, and the child's files."""
    args: list[str] = []
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    prefixes.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    for prefix in sorted(prefixes):
        if not prefix.startswith("/usr/"):
            args += ["--ro-bind", prefix, prefix]
    if os.path.realpath(sys.prefix) != sys.prefix:  # a venv reached through a symlink
        args += ["--ro-bind", sys.prefix, sys.prefix]
    for name in CHILD_FILES:
        args += ["--ro-bind", str(HOST_DIR / name), f"{VIEW_DIR}/{name}"]
    return args


def bwrap_command(tmpfs_bytes: int) -> list[str] | None:
    """The bwrap argv prefix of a kernel-isolated run, or None where bwrap cannot isolate here."""
    if not _bwrap_works():
        return None
    return ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--uid", _NOBODY, "--gid", _NOBODY, "--hostname", "sandbox", *_view_binds(),
            "--proc", "/proc", "--dev", "/dev", "--size", str(tmpfs_bytes), "--tmpfs", SANDBOX_DIR,
            "--chdir", SANDBOX_DIR]


@lru_cache(maxsize=1)
def _bwrap_works() -> bool:
    """bwrap is installed and this kernel lets it build the namespaces (probed once per process)."""
    if shutil.which("bwrap") is None:
        return False
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
           "--uid", _NOBODY, "--gid", _NOBODY, *_view_binds(), "--proc", "/proc", "--dev", "/dev",
           "--tmpfs", SANDBOX_DIR, "--chdir", SANDBOX_DIR, sys.executable, "-I", "-B", "-c", "pass"]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def isolation_available() -> bool:
    return _bwrap_works()


@lru_cache(maxsize=1)
def _warn_unsafe() -> None:
    warnings.warn(f"{UNSAFE_ENV}=1: running model-written code WITHOUT kernel isolation (Python audit hooks and "
                  "rlimits only); do this only on a machine you can afford to lose", RuntimeWarning, stacklevel=3)


def require_isolation() -> None:
    """Raise `IsolationUnavailable` unless kernel isolation works here or the user opted out of it."""
    if not _bwrap_works() and os.environ.get(UNSAFE_ENV) != "1":
        raise IsolationUnavailable(_REFUSAL)


def launcher(tmpfs_bytes: int) -> tuple[list[str], str | None]:
    """(argv that starts the sandboxed child, its working directory inside the sandbox or None for a host
    temporary directory)."""
    cmd = bwrap_command(tmpfs_bytes)
    if cmd is not None:
        return [*cmd, sys.executable, "-I", "-B", f"{VIEW_DIR}/{CHILD_FILES[0]}"], SANDBOX_DIR
    require_isolation()
    _warn_unsafe()
    return [*network_namespace_prefix(), sys.executable, "-I", "-B", str(HOST_DIR / CHILD_FILES[0])], None


_REFUSAL = (
    "refusing to run model-written code: kernel isolation is unavailable (bubblewrap is not installed or this "
    "kernel does not allow unprivileged user namespaces). Install it (Debian/Ubuntu: apt-get install bubblewrap) "
    f"or, on a disposable machine, pass --unsafe-code-exec (env {UNSAFE_ENV}=1) to run with Python-level guards only.")
