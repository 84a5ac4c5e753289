"""Per-request timestamps for the service's time breakdown (`python -m benchmarks.serve_breakdown`).

Off unless the environment variable MBD_TRACE_DIR names a directory when the process imports this module;
then every process of the service (ingress, decoder replica, engine thread) appends one JSON line per event,
`[wall time, request id, event, value]`, to its own file there. Wall time (time.time) is comparable across the
processes of one machine, which is where the breakdown is taken. When off, `mark` is one attribute test.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import IO

DIR = os.environ.get("MBD_TRACE_DIR") or None
_out: IO[str] | None = None
_lock = threading.Lock()


def mark(rid: str, event: str, value: float = 0) -> None:
    """Record `event` of request `rid` now (value: a token count or a duration, per event)."""
    global _out
    if DIR is None:
        return
    t = time.time()
    with _lock:
        if _out is None:
            Path(DIR).mkdir(parents=True, exist_ok=True)
            _out = open(Path(DIR) / f"{os.getpid()}.jsonl", "a", buffering=1)
        _out.write(json.dumps([t, rid, event, value]) + "\n")
