"""A sweep's output directory at a URI (`s3://`, `gs://`, `file://`, ...; mbd/storage.py): the results store
appends JSON lines per problem, which an object store cannot do, so the sweep works in a local staging directory
that starts as a copy of what the URI already holds (a re-run then skips what is stored there) and whose changed
files are uploaded while the sweep runs and once more at its end. A local output directory is used as it is."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mbd import storage
from mbd.eval.report import SweepSummary


class StagedOutput:
    """`local`: where the sweep writes; `dest`: where its files belong (equal for a local output directory)."""

    def __init__(self, dest: str, local: Path):
        self.dest, self.local = dest, local
        self._uploaded: dict[Path, tuple[int, int]] = {}  # file -> (size, mtime_ns) at its last upload
        self._last = time.monotonic()

    @property
    def remote(self) -> bool:
        return storage.is_uri(self.dest)

    def pull(self) -> None:
        """Copy what the URI holds into the staging directory (nothing there yet: a fresh sweep)."""
        if storage.exists(self.dest):
            storage.download_dir(self.dest, self.local)
        self._uploaded = self._changed()

    def push(self, every_s: float = 0.0) -> int:
        """Upload the files changed since the last push, unless one came less than `every_s` ago (an object is
        rewritten whole, so pushing per record would cost quadratic traffic); returns the files uploaded."""
        if not self.remote or time.monotonic() - self._last < every_s:
            return 0
        changed = self._changed()
        for path, stamp in changed.items():
            storage.write_bytes(storage.join(self.dest, *path.relative_to(self.local).parts), path.read_bytes())
            self._uploaded[path] = stamp
        self._last = time.monotonic()
        return len(changed)

    def _changed(self) -> dict[Path, tuple[int, int]]:
        stamps = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in self.local.rglob("*") if p.is_file()}
        return {p: s for p, s in stamps.items() if self._uploaded.get(p) != s}

    def published(self, summary: SweepSummary) -> SweepSummary:
        """The sweep summary with its paths at the URI (rewritten in summary.json too), for a remote output."""
        if not self.remote:
            return summary
        local = str(self.local)

        def moved(p: str) -> str:
            return storage.join(self.dest, *Path(p).relative_to(local).parts) if p.startswith(local) else p

        summary = summary.model_copy(update={
            "output_dir": self.dest, "report_path": moved(summary.report_path),
            "parquet_path": moved(summary.parquet_path), "plots": [moved(p) for p in summary.plots]})
        (self.local / "summary.json").write_text(json.dumps(summary.model_dump(), indent=2))
        return summary


@contextmanager
def staged_output(output_dir: str) -> Iterator[StagedOutput]:
    """The sweep's output directory as a local one; for a URI, a staging copy pushed when the block ends (also on
    an error: every stored record is a finished problem, worth keeping for the re-run)."""
    if not storage.is_uri(output_dir):
        yield StagedOutput(output_dir, Path(output_dir))
        return
    stage = StagedOutput(output_dir, Path(tempfile.mkdtemp(prefix="mbd-sweep-")))
    try:
        stage.pull()
        try:
            yield stage
        finally:
            stage.push()
    finally:
        shutil.rmtree(stage.local, ignore_errors=True)
