"""The one progress line: counts, the job's figures, elapsed time and an ETA from this run's rate only (work
done before a resume is not), redrawn on a terminal and printed every `every_s` elsewhere."""

import io

from mbd.progress import ProgressLine, hms


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_hms():
    assert [hms(s) for s in (0, 59, 60, 185, 3600, 7659)] == ["0s", "59s", "1m00s", "3m05s", "1h00m", "2h07m"]


def test_eta_counts_only_this_runs_rate_and_lines_come_every_every_s():
    out, clock = io.StringIO(), Clock()
    line = ProgressLine("sweep problems", 100, done=40, show=True, every_s=30, stream=out, clock=clock)
    clock.t += 10
    line.update(5, accuracy="gsm8k 60.0%")  # 5 in 10 s: 55 left at 0.5/s = 110 s
    assert out.getvalue() == ""  # not a terminal, and under every_s since the start
    head = "sweep problems: {}/100 ({}%) · accuracy gsm8k 60.0% · {} elapsed"  # times from the fake clock above
    assert line.line() == head.format(45, 45, hms(10)) + f" · ETA {hms(55 / (5 / 10))}"
    clock.t += 20
    line.update(done=55)
    # 15 done in 30 s, 45 left
    assert out.getvalue() == head.format(55, 55, hms(30)) + f" · ETA {hms(45 / (15 / 30))}\n"
    clock.t += 1
    line.update(done=100)
    line.close()
    assert out.getvalue().splitlines()[-1] == head.format(100, 100, hms(31))
    assert len(out.getvalue().splitlines()) == 2


def test_a_terminal_gets_the_line_redrawn_in_place():
    out, clock = Tty(), Clock()
    line = ProgressLine("train tiny steps", 4, stream=out, clock=clock)
    clock.t += 2
    line.update(done=1, loss="2.5")
    # 1 done in the fake clock's 2 s, 3 left at 0.5/s
    drawn = f"\r\033[Ktrain tiny steps: 1/4 (25%) · loss 2.5 · {hms(2)} elapsed · ETA {hms(3 / (1 / 2))}"
    assert out.getvalue() == drawn
    line.close()
    assert out.getvalue().endswith(drawn + "\n")
    quiet = Tty()
    ProgressLine("x", 4, show=False, stream=quiet, clock=clock).update(1)  # --no-progress: full lines only
    assert quiet.getvalue() == ""
