"""Storage by URI, so that every node of a cluster sees a run's checkpoints, an expansion's rows, a sweep's results
and exported models: a plain local path (one machine) or a filesystem URI (`file://`, `s3://`, `gs://`,
`hdfs://`, ...) through pyarrow's filesystem layer, the one Ray Data and Ray Train use too.

Credentials come from the environment only (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION),
never from a file in the repository. An S3-compatible server (MinIO, Ceph, ...) is named by AWS_ENDPOINT_URL, the
AWS CLI's variable, which pyarrow itself does not read, or in the URI's query with pyarrow's own options
(`s3://bucket/runs?endpoint_override=host:9000&scheme=http`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import pyarrow.fs as pafs


def is_uri(path: str | Path) -> bool:
    return "://" in str(path)


def filesystem(path: str | Path) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it); a local path is made absolute."""
    if is_uri(path):
        return pafs.FileSystem.from_uri(_with_endpoint(str(path)))
    return pafs.LocalFileSystem(), str(Path(path).resolve())


def _with_endpoint(uri: str) -> str:
    """An s3:// URI with AWS_ENDPOINT_URL as pyarrow's query options, unless the URI names an endpoint."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if not uri.startswith("s3://") or not endpoint or "endpoint_override=" in uri:
        return uri
    url = urlsplit(endpoint)
    options = f"endpoint_override={url.netloc}&scheme={url.scheme or 'https'}"
    return uri + ("&" if "?" in uri else "?") + options


def join(base: str | Path, *parts: str) -> str:
    """`base/part/...` for a local path or a URI (its query options kept at the end)."""
    if not is_uri(base):
        return str(Path(base, *parts))
    head, sep, query = str(base).partition("?")
    return "/".join([head.rstrip("/"), *(p.strip("/") for p in parts)]) + sep + query


def exists(path: str | Path) -> bool:
    fs, p = filesystem(path)
    return fs.get_file_info(p).type != pafs.FileType.NotFound


def list_files(path: str | Path, suffix: str = "") -> list[str]:
    """The files below `path` (recursive) ending in `suffix`, as paths inside its filesystem, sorted."""
    fs, p = filesystem(path)
    if fs.get_file_info(p).type == pafs.FileType.NotFound:
        return []
    infos = fs.get_file_info(pafs.FileSelector(p, recursive=True))
    return sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(suffix))


def list_names(path: str | Path, prefix: str = "") -> list[str]:
    """The names of the entries directly in directory `path` that start with `prefix`, sorted."""
    fs, p = filesystem(path)
    if fs.get_file_info(p).type != pafs.FileType.Directory:
        return []
    return sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(p)) if i.base_name.startswith(prefix))


def read_bytes(path: str | Path) -> bytes:
    fs, p = filesystem(path)
    with fs.open_input_stream(p) as fh:
        return fh.read()


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write (replace) one file, creating its parent directories."""
    fs, p = filesystem(path)
    parent = p.rsplit("/", 1)[0]
    if parent and parent != p:
        fs.create_dir(parent, recursive=True)
    with fs.open_output_stream(p) as fh:
        fh.write(data)


def read_text(path: str | Path) -> str:
    return read_bytes(path).decode("utf-8")


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def append_text(path: str | Path, text: str) -> None:
    """Append to a text file (object stores cannot append: the file is rewritten)."""
    write_text(path, (read_text(path) if exists(path) else "") + text)


def upload_dir(local_dir: str | Path, dest: str | Path) -> None:
    """Copy a local directory's contents to `dest` (a local path or a URI)."""
    fs, p = filesystem(dest)
    fs.create_dir(p, recursive=True)
    pafs.copy_files(str(Path(local_dir).resolve()), p, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)


def download_dir(src: str | Path, local_dir: str | Path) -> Path:
    """Copy `src`'s contents (a local path or a URI) into a local directory."""
    fs, p = filesystem(src)
    Path(local_dir).mkdir(parents=True, exist_ok=True)
    pafs.copy_files(p, str(Path(local_dir).resolve()), source_filesystem=fs,
                    destination_filesystem=pafs.LocalFileSystem())
    return Path(local_dir)


@contextmanager
def local_dir_for(dest: str | Path) -> Iterator[Path]:
    """A local directory to write `dest`'s contents into: `dest` itself when local, else a temporary directory
    uploaded to the URI when the block ends without an error."""
    if not is_uri(dest):
        Path(dest).mkdir(parents=True, exist_ok=True)
        yield Path(dest)
        return
    tmp = Path(tempfile.mkdtemp(prefix="mbd-upload-"))
    try:
        yield tmp
        upload_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def local_copy_of(src: str | Path) -> Iterator[Path]:
    """A local directory with `src`'s contents: `src` itself when local, else a temporary download."""
    if not is_uri(src):
        yield Path(src)
        return
    tmp = Path(tempfile.mkdtemp(prefix="mbd-download-"))
    try:
        yield download_dir(src, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
