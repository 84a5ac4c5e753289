"""Ray Data's Parquet reader, as the pipelines use it: the V1 datasource.

Ray 2.60's default (DataSourceV2) lists the files through a pool of footer-reading actors (up to 32, each a worker
process) that it starts again at every execution of the dataset, and every training epoch is one execution of the
streaming split. The pipelines read a few small files per run (`mbd expand`'s layout rows), so the pool only adds
process starts, at the step that starts each training pass (docs/performance.md has the measurement).
"""

from __future__ import annotations

from typing import Any

import ray


def read_parquet(paths: str | list[str], **kwargs: Any) -> ray.data.Dataset:
    """`ray.data.read_parquet` through the V1 datasource; the reader is chosen when the dataset is built, so the
    session's DataContext is left as it was."""
    ctx = ray.data.DataContext.get_current()
    was, ctx.use_datasource_v2 = ctx.use_datasource_v2, False
    try:
        return ray.data.read_parquet(paths, **kwargs)
    finally:
        ctx.use_datasource_v2 = was
