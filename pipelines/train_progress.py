"""How a training run shows its steps on the driver: rank 0 pushes each step's metrics to a small actor on the
driver's node, and the driver polls it into the one progress line (`mbd.progress`). Ray Train gets the metrics
of each checkpoint's step with the checkpoint (`ray.train.report` blocks until the controller's next poll)."""

from __future__ import annotations

import threading
import time

import ray

from mbd.progress import ProgressLine
from mbd.train_config import TrainConfig

POLL_S = 0.5
SHOWN = {"loss": "loss {:.4g}", "probe_loss": "probe {:.4g}", "tokens_per_s": "{:.0f} tok/s", "mfu": "MFU {:.1%}",
         "step_s": "{:.2f} s/step"}


@ray.remote(num_cpus=0)
class Progress:
    """Step metrics pushed by rank 0 (fire-and-forget) and polled by the driver."""

    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []

    def log(self, metrics: dict[str, float]) -> None:
        self.history.append(metrics)

    def since(self, n: int) -> list[dict[str, float]]:
        return self.history[n:]


def follow(progress, fit_thread: threading.Thread, total: int, name: str, show: bool) -> list[dict[str, float]]:
    """Poll the progress actor until the fit thread ends, into the progress line; the step history."""
    history: list[dict[str, float]] = []
    line = ProgressLine(f"train {name} steps", total, show=show)
    while True:
        alive = fit_thread.is_alive()
        new = ray.get(progress.since.remote(len(history)))
        history += new
        for m in new:
            line.update(done=int(m["step"]), **{k: f.format(m[k]) for k, f in SHOWN.items() if k in m})
        if not alive:
            break
        time.sleep(POLL_S)
    line.close()
    return history


def one_time_note(cfg: TrainConfig) -> str:
    """Why the first step takes a while (a minute or more on CPU), said before the line stands still."""
    return (f"    the first step waits for one-time work: {cfg.num_workers} worker(s) start, load the model and "
            "initialise DeepSpeed")
