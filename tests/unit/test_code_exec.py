"""The sandbox: each guard is proved by a program that tries to break it."""

import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mbd.eval import isolation
from mbd.eval.code_exec import CallOutput, SandboxLimits, run_calls, run_program
from mbd.eval.isolation import UNSAFE_ENV, IsolationUnavailable, network_namespace_prefix
from mbd.eval.value_codec import Opaque, ValueTooLarge, decode_value, encode_value


def _children(pid: int) -> list[int]:
    kids = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(d))
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_plain_program_passes_and_its_stdout_comes_back():
    r = run_program("print(sum(range(10)))")
    assert (r.status, r.stdout) == ("passed", "45\n")


def test_exception_fails_with_its_message():
    r = run_program("raise ValueError('bad input')")
    assert r.status == "failed" and r.detail == "ValueError: bad input"


def test_infinite_loop_times_out():
    r = run_program("while True:\n    pass", SandboxLimits(wall_s=1.0))
    assert r.status == "timeout"


@pytest.mark.parametrize("bomb", [
    "import os\nwhile True:\n    os.fork()",
    "import subprocess\nwhile True:\n    subprocess.Popen(['sleep', '100'])",
    "import _posixsubprocess\n_posixsubprocess.fork_exec()",
    "import os\nos.system('sleep 100 &')",
    "import ctypes\nctypes.CDLL(None).fork()",
])
def test_fork_bomb_is_contained(bomb):
    r = run_program(bomb, SandboxLimits(wall_s=5.0))
    assert r.status == "failed" and "not allowed" in r.detail


def test_thread_bomb_is_contained():
    src = ("import threading, time\nn = 0\ntry:\n    for _ in range(100000):\n"
           "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n        n += 1\n"
           "except RuntimeError:\n    pass\nprint(n)")
    r = run_program(src, SandboxLimits(wall_s=20.0, memory_bytes=1 << 30))
    assert r.status == "passed" and int(r.stdout) < 100000  # the rlimits stopped it, not the loop bound


@pytest.mark.parametrize("hog", ["x = bytearray(16 << 30)", "xs = []\nwhile True:\n    xs.append(' ' * 10**7)"])
def test_memory_hog_is_stopped(hog):
    r = run_program(hog, SandboxLimits(wall_s=20.0, memory_bytes=512 << 20))
    assert r.status == "failed" and ("MemoryError" in r.detail or "killed" in r.detail)


def test_socket_connect_is_blocked():
    with socket.socket() as server:  # a loopback listener the sandbox must not reach
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        r = run_program(f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))")
        assert r.status == "failed" and "socket" in r.detail
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever connected


@pytest.mark.skipif(not network_namespace_prefix(), reason="no network namespace available on this host")
def test_child_runs_in_an_empty_network_namespace():
    r = run_program("print(open('/proc/net/dev').read())")
    interfaces = [line.split(":")[0].strip() for line in r.stdout.splitlines() if ":" in line]
    assert r.status == "passed" and interfaces == ["lo"]


def test_write_outside_the_sandbox_is_blocked(tmp_path):
    target = tmp_path / "escape.txt"
    r = run_program(f"open({str(target)!r}, 'w').write('x')")
    assert r.status == "failed" and "PermissionError" in r.detail
    assert not target.exists()


def test_delete_outside_the_sandbox_is_blocked(tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("keep")
    r = run_program(f"import os\nos.remove({str(victim)!r})")
    assert r.status == "failed" and victim.read_text() == "keep"


def test_directory_fd_escape_is_blocked():
    r = run_program("import os\nfd = os.open('/', os.O_RDONLY)\nos.open('tmp/x', os.O_WRONLY | os.O_CREAT, dir_fd=fd)")
    assert r.status == "failed" and "not allowed" in r.detail


def test_signals_to_other_processes_are_blocked():
    r = run_program("import os\nos.kill(os.getppid(), 0)")
    assert r.status == "failed" and "os.kill" in r.detail


def test_writing_inside_the_sandbox_works():
    r = run_program("open('a.txt', 'w').write('ok')\nprint(open('a.txt').read())")
    assert (r.status, r.stdout) == ("passed", "ok\n")


def test_numpy_imports_under_the_guards():
    r = run_program("import numpy as np\nprint(np.arange(4).sum())")
    assert (r.status, r.stdout) == ("passed", "6\n")


def _collect(source, inputs, time_limits, **kw):
    outs: list[CallOutput] = []
    result = run_calls(source, "f", inputs, time_limits, lambda o: outs.append(o) or True, **kw)
    return result, outs


def test_run_calls_returns_values_errors_and_per_input_timeouts():
    src = ("def f(x):\n    while x == 2:\n        pass\n    if x == 3:\n        raise KeyError(x)\n"
           "    return (x, {x}, [x * 1.5])")
    result, outs = _collect(src, [[1], [2], [3], [4]], [5.0, 0.5, 5.0, 5.0])
    assert result.status == "passed"
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert outs[0].value == (1, {1}, [1.5]) and outs[3].value == (4, {4}, [6.0])
    assert outs[1].timed_out and outs[1].value is None
    assert outs[2].error == "KeyError: 3"


def test_a_sleeping_call_is_caught_by_the_wall_deadline():
    r, outs = _collect("import time\ndef f(x):\n    time.sleep(60)", [[1]], [0.5], limits=SandboxLimits(wall_s=2.0))
    assert r.status == "timeout" and outs == []  # it uses no CPU, so only the wall deadline can stop it


def test_cpu_budget_is_enforced_by_the_kernel():
    r = run_program("while True:\n    pass", SandboxLimits(wall_s=30.0, cpu_s=1.0))
    assert r.status == "timeout" and "CPU" in r.detail


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def _runs_candidate(pid: int) -> bool:
    try:
        return b"time.sleep" not in Path(f"/proc/{pid}/cmdline").read_bytes() and \
            Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith((b"python", b"python3", b"python3.11")) \
            and b"sandbox_child.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and PR_SET_PDEATHSIG")
def test_sandbox_dies_with_its_parent(tmp_path):
    code = "from mbd.eval.code_exec import *\nrun_program('import time\\ntime.sleep(300)', SandboxLimits(wall_s=300))"
    repo = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=repo,
                              env={**os.environ, "PYTHONPATH": str(repo), "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 60
        while not (runners := [k for k in _descendants(parent.pid) if _runs_candidate(k)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runners, "the sandbox never started"
        time.sleep(1.0)  # let it reach its sleep
        tree = _descendants(parent.pid)
        assert all(_alive(k) for k in runners)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(k) for k in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(k) for k in tree)


def test_run_calls_stops_when_the_callback_says_so():
    outs: list[CallOutput] = []
    r = run_calls("def f(x):\n    return x", "f", [[i] for i in range(50)], [1.0] * 50,
                  lambda o: outs.append(o) and False)
    assert r.status == "failed" and len(outs) == 1


def test_run_calls_reports_load_errors():
    r, outs = _collect("def f(x) return x", [[1]], [1.0])
    assert r.status == "failed" and "SyntaxError" in r.detail and outs == []
    r, outs = _collect("def g(x):\n    return x", [[1]], [1.0])
    assert r.status == "failed" and "'f' is not defined" in r.detail


def test_run_calls_compares_large_outputs_against_the_reference_in_the_child():
    ref = "def f(n):\n    return list(range(n))"
    wrong = "def f(n):\n    return list(range(n))[::-1]"
    for source, same in ((ref, True), (wrong, False)):
        result, outs = _collect(source, [[5], [3]], [5.0, 5.0], max_items=4, reference_source=ref,
                                reference_indices=[0])
        assert result.status == "passed"
        assert outs[0].matches_reference is same and outs[0].value is None
        assert outs[1].value == ([0, 1, 2] if same else [2, 1, 0])


def test_run_calls_flags_values_over_the_item_budget():
    _, outs = _collect("def f(n):\n    return list(range(n))", [[3], [100]], [5.0, 5.0], max_items=10)
    assert outs[0].value == [0, 1, 2] and not outs[0].too_large
    assert outs[1].too_large and outs[1].value is None


def test_codec_round_trips_python_and_numpy_values():
    values = [None, True, 3, -(10**40), 2.5, math.inf, "s", b"\x00\xff", 1 + 2j, (1, (2,)), [1, [2]], {1, 2},
              frozenset({3}), {"a": (1,), 2: [3]}, np.float32(1.5), np.int64(7), np.arange(6).reshape(2, 3)]
    back = decode_value(encode_value(values))
    for v, b in zip(values, back):
        assert type(b) is type(v)
        assert np.array_equal(b, v) if isinstance(v, np.ndarray) else b == v
    assert math.isnan(decode_value(encode_value(math.nan)))


def test_codec_marks_unknown_objects_opaque_and_enforces_the_budget():
    import re

    m = decode_value(encode_value(re.match("a", "a")))
    assert isinstance(m, Opaque) and m.type_name == "Match" and m != decode_value(encode_value(re.match("a", "a")))
    with pytest.raises(ValueTooLarge):
        encode_value(list(range(100)), max_items=50)


def test_without_isolation_code_runs_only_on_explicit_opt_out(monkeypatch):
    monkeypatch.setattr(isolation, "_bwrap_works", lambda: False)
    monkeypatch.delenv(UNSAFE_ENV, raising=False)
    with pytest.raises(IsolationUnavailable, match="--unsafe-code-exec"):
        run_program("print(1)")
    monkeypatch.setenv(UNSAFE_ENV, "1")
    with pytest.warns(RuntimeWarning, match="WITHOUT kernel isolation"):
        isolation._warn_unsafe.cache_clear()
        r = run_program("print(1)")
    assert r.status == "passed" and r.stdout.strip() == "1"
