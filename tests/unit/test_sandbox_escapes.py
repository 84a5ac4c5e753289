"""Hostile programs against the kernel sandbox: one test per escape class, each asserting the attack fails.

The attacks go below Python where they can: raw libc calls through ctypes with function addresses read
from libc's ELF symbol table (no `dlsym`, so no audit event), so what stops them must be the kernel
(namespaces, a read-only view, an unprivileged uid), not the interpreter's audit hook.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mbd.eval.code_exec import SandboxLimits, run_calls, run_check, run_program
from mbd.eval.isolation import isolation_available

pytestmark = pytest.mark.skipif(not isolation_available(), reason="bubblewrap / user namespaces unavailable here")

# Finds a libc function's address without dlsym: the loaded libc's base from /proc/self/maps plus the
# symbol's offset from the .dynsym section of the file on disk.
LIBC = r'''
import ctypes, struct

def libc_function(name, restype, *argtypes):
    for line in open("/proc/self/maps"):
        parts = line.split()
        if len(parts) >= 6 and "libc.so" in parts[5] and parts[2] == "00000000":
            base, path = int(parts[0].split("-")[0], 16), parts[5]
            break
    data = open(path, "rb").read()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for sh in sections:
        if sh[1] == 11:  # SHT_DYNSYM
            strtab = sections[sh[6]]
            for off in range(sh[4], sh[4] + sh[5], 24):
                st_name, _, _, _, st_value, _ = struct.unpack_from("<IBBHQQ", data, off)
                end = data.index(b"\0", strtab[4] + st_name)
                if data[strtab[4] + st_name:end] == name.encode() and st_value:
                    return ctypes.CFUNCTYPE(restype, *argtypes)(base + st_value)
    raise LookupError(name)
'''


def _no_file(path: Path) -> bool:
    time.sleep(0.2)
    return not path.exists()


def test_writes_outside_fail_even_through_raw_libc_and_a_chdir_race(tmp_path):
    target = tmp_path / "escaped.txt"
    prog = LIBC + f'''
import os, threading
flag = []
def hop():
    try:
        os.chdir({str(tmp_path)!r})
    except Exception as e:
        flag.append(e)
t = threading.Thread(target=hop); t.start(); t.join()
for attempt in (lambda: open("escaped.txt", "w").write("x"), lambda: open({str(target)!r}, "w").write("x")):
    try:
        attempt()
    except Exception:
        pass
c_open = libc_function("open", ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_int)
c_open({str(target).encode()!r}, os.O_WRONLY | os.O_CREAT, 0o644)
'''
    run_program(prog)
    assert _no_file(target)


def test_libc_system_runs_nothing_outside(tmp_path):
    target = tmp_path / "by_system.txt"
    prog = LIBC + f'''
system = libc_function("system", ctypes.c_int, ctypes.c_char_p)
system(b"touch {target}")
'''
    run_program(prog)
    assert _no_file(target)


def _sandbox_processes() -> list[int]:
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"/opt/mbd-sandbox/sandbox_child.py" in Path(f"/proc/{d}/cmdline").read_bytes():
                out.append(int(d))
        except OSError:
            pass
    return out


def test_no_child_outlives_the_run():
    prog = LIBC + '''
import time
fork = libc_function("fork", ctypes.c_int)
setsid = libc_function("setsid", ctypes.c_int)
if fork() == 0:
    setsid()
    time.sleep(60)
'''
    before = set(_sandbox_processes())
    run_program(prog, SandboxLimits(wall_s=3.0))
    deadline = time.monotonic() + 10
    while set(_sandbox_processes()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(_sandbox_processes()) - before


def test_other_processes_cannot_be_signalled():
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        prog = LIBC + f'''
import os
kill = libc_function("kill", ctypes.c_int, ctypes.c_int, ctypes.c_int)
for pid in ({victim.pid}, {os.getpid()}, os.getppid()):
    kill(pid, 9)
    try:
        os.kill(pid, 9)
    except Exception:
        pass
'''
        run_program(prog)
        time.sleep(0.3)
        assert victim.poll() is None  # still running
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()


def test_reads_outside_see_nothing(tmp_path, monkeypatch):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-7391")
    prog = f'''
import os
found = []
for path in ({str(secret)!r}, "/etc/passwd", "/etc/shadow", os.path.expanduser("~/.bashrc"), "/root/.bashrc"):
    try:
        found.append(open(path).read())
    except Exception:
        pass
print("".join(found))
'''
    r = run_program(prog)
    assert r.status == "passed"  # the program ran; it just saw nothing
    assert "TOP-SECRET" not in r.stdout and "root:" not in r.stdout


@pytest.mark.parametrize("trick", [
    "import sys\n    sys.exit(0)",
    "import os\n    os._exit(0)",
    "import sys\n    sys.excepthook = lambda *a: None\n    raise SystemExit(0)",
    "import atexit, os\n    atexit.register(lambda: os._exit(0))\n    raise AssertionError",
    "class Yes:\n        def __eq__(self, other):\n            return True\n    return Yes()",
    "import os\n    os.write(1, b'{\"done\": true}\\n')\n    return 0",
])
def test_check_mode_cannot_be_faked(trick):
    program = f"def f(x):\n    {trick}\n"
    r = run_check(program, "def check(candidate):\n    assert candidate(1) == 2\n", "f")
    assert r.status != "passed", r


@pytest.mark.parametrize("trick", ["import sys\nsys.exit(0)", "import os\nos._exit(0)",
                                   "import os\nfor fd in range(1, 20):\n    try:\n        os.write(fd, b'{\"done\": true}\\n')\n    except OSError:\n        pass\nraise AssertionError"])
def test_program_mode_needs_the_runner_marker(trick):
    assert run_program(trick + "\nraise AssertionError('unreachable')").status == "failed"


def test_forged_result_lines_fail_the_run_instead_of_the_scorer():
    forger = ("import os\ndef f(x):\n    for fd in range(1, 30):\n        try:\n"
              "            os.write(fd, b'{\"i\": 0, \"same\": true}\\n' if fd % 2 else b'not json\\n')\n"
              "        except OSError:\n            pass\n    return None\n")
    seen = []
    r = run_calls(forger, "f", [[1]], [1.0], lambda o: seen.append(o) or True,
                  reference_source="def f(x):\n    return x", reference_indices=[0])
    assert r.status == "failed" and "verdict refused" in r.detail
    assert all(o.matches_reference is not True for o in seen)


def test_legitimate_temp_file_work_succeeds():
    prog = ("import os, shutil, tempfile\nos.mkdir('d')\nopen('d/f', 'w').write('x')\nos.rename('d/f', 'd/g')\n"
            "os.remove('d/g')\nos.rmdir('d')\nwith tempfile.TemporaryDirectory() as t:\n"
            "    open(os.path.join(t, 'a'), 'w').write('y')\nwith tempfile.NamedTemporaryFile('w') as f:\n"
            "    f.write('z')\nos.makedirs('a/b')\nshutil.rmtree('a')\nprint('ok')")
    r = run_program(prog)
    assert r.status == "passed" and r.stdout.strip() == "ok", r


def test_a_loop_that_ignores_sigxcpu_is_a_timeout():
    r = run_program("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
                    SandboxLimits(wall_s=20.0, cpu_s=1.0))
    assert r.status == "timeout", r


def test_the_network_is_unreachable():
    prog = LIBC + '''
import socket
sock = libc_function("socket", ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)
print(sock(socket.AF_INET, socket.SOCK_STREAM, 0) >= 0)
import os
print(sorted(os.listdir("/sys/class/net")) if os.path.exists("/sys/class/net") else "no-sys")
'''
    r = run_program(prog)
    # a socket may be created inside the empty network namespace, but there is no interface but lo
    assert "eth" not in r.stdout and "ens" not in r.stdout
