"""Per-request timestamps for the service's time breakdown (`python -m benchmarks.serve_breakdown`).

Off unless the environment variable MBD_TRACE_DIR names a directory; then each `Trace` (one per ingress replica,
decoder replica and engine process) appends one JSON line per event, `[wall time, request id, event, value]`, to
its own file there. Wall time (time.time) is comparable across the processes of one machine, which is where the
breakdown is taken. When off, `mark` is one attribute test.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import IO


class Trace:
    def __init__(self, name: str):
        d = os.environ.get("MBD_TRACE_DIR")
        self._out: IO[str] | None = None
        if d:
            Path(d).mkdir(parents=True, exist_ok=True)
            self._out = open(Path(d) / f"{name}-{os.getpid()}.jsonl", "a", buffering=1)
        self._lock = threading.Lock()  # a replica's event loop and its reader thread both write

    @property
    def enabled(self) -> bool:
        return self._out is not None

    def mark(self, rid: str, event: str, value: float = 0) -> None:
        """Record `event` of request `rid` now (value: a token count or a duration, per event)."""
        if self._out is None:
            return
        line = json.dumps([time.time(), rid, event, value]) + "\n"
        with self._lock:
            self._out.write(line)
