"""Delta tables on an S3-compatible object store: what delta-rs needs to commit there safely.

A Delta commit is "create `_delta_log/<version>.json` unless it exists". A local file system
gives that atomically (link, rename-noreplace); S3 only with a conditional PUT
(`If-None-Match: *`, which S3 and most S3-compatible servers support), or with a lock
provider (DynamoDB). The options below always ask delta-rs for conditional put, explicitly:
two writers can then never both commit one version (tests/test_object_store.py races two
processes). delta-rs 1.6 also won that race on moto without the option, but object_store
documents conditional put as off unless requested, and we do not rely on a default.

Credentials come from the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, and
`AWS_SESSION_TOKEN` if set), never from a settings file, and are not part of any repr.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


@dataclass(frozen=True)
class S3Location:
    endpoint: str = ""          # empty: AWS's own; else e.g. http://127.0.0.1:9000
    region: str = "us-east-1"

    def storage_options(self) -> dict[str, str]:
        """delta-rs `storage_options` (object_store's S3 keys), credentials from the
        environment."""
        opts = {"AWS_REGION": self.region, "conditional_put": "etag"}
        if self.endpoint:
            opts["AWS_ENDPOINT_URL"] = self.endpoint
            if self.endpoint.startswith("http://"):
                opts["AWS_ALLOW_HTTP"] = "true"
        for var in CREDENTIAL_VARS:
            if os.environ.get(var):
                opts[var] = os.environ[var]
        return opts


# --- paths of tables on S3 -------------------------------------------------------------------

def is_remote(path) -> bool:
    return isinstance(path, S3Path)


def table_root(location: str, s3: S3Location) -> "Path | S3Path":
    """`location` as a path object: a local directory, or `s3://bucket/prefix`."""
    if location.startswith("s3://"):
        return S3Path(location, _filesystem(s3), s3)
    return Path(location).resolve()


def configure_env(s3: S3Location) -> None:
    """delta-rs and pyarrow in this process and its children (Spark's Python workers) read
    the endpoint and region from the environment: set them from the settings."""
    for key, value in s3.storage_options().items():
        if key.startswith("AWS_") and key not in CREDENTIAL_VARS:
            os.environ[key] = value
    os.environ["AWS_CONDITIONAL_PUT"] = "etag"


_FILESYSTEMS: dict[S3Location, object] = {}


def _filesystem(s3: S3Location):
    fs = _FILESYSTEMS.get(s3)
    if fs is None:
        from pyarrow import fs as pafs
        # delayed open: a small object is written with one PUT, not a multipart upload's
        # three requests (an open, a part, a completion)
        kw = {"region": s3.region, "allow_delayed_open": True}
        if s3.endpoint:
            scheme, _, host = s3.endpoint.partition("://")
            kw.update(endpoint_override=host.rstrip("/"), scheme=scheme)
        fs = _FILESYSTEMS[s3] = pafs.S3FileSystem(**kw)
    return fs


# Reads one process has in flight at once (the commit files and data files of a batch):
# bounded, as the server and the store's per-prefix rate are shared with every writer.
READ_THREADS = 8
_pool: tuple[int, ThreadPoolExecutor] | None = None


def concurrently(fn, items):
    """`map(fn, items)`, in order, READ_THREADS at a time; an exception is raised where its
    item is reached, as `map` would."""
    global _pool
    items = list(items)
    if len(items) < 2:
        return map(fn, items)
    if _pool is None or _pool[0] != os.getpid():   # a forked Python worker: a pool of its own
        _pool = (os.getpid(), ThreadPoolExecutor(READ_THREADS, thread_name_prefix="s3-read"))
    return _pool[1].map(fn, items)


_HANDLERS: dict[tuple[str, S3Location], object] = {}


def read_objects(s3: S3Location, objects: list[tuple[str, int | None]]) -> list[bytes | None]:
    """The bytes of each object (`s3://bucket/key`, and its size if known), in order; None for
    one that does not exist. READ_THREADS at a time, through delta-rs's object store client:
    an object of known size is one GET (pyarrow's file system asks a HEAD before every read),
    another a HEAD and a GET."""
    from deltalake.fs import DeltaStorageHandler

    split = [(uri[len("s3://"):].split("/", 1), size) for uri, size in objects]
    handlers = {}
    for bucket in {b for (b, _), _ in split}:
        sizes = {key: size for (b, key), size in split if b == bucket and size is not None}
        if sizes:      # told the sizes at its making (~10 ms): one per call
            handlers[bucket] = DeltaStorageHandler(f"s3://{bucket}", s3.storage_options(),
                                                   known_sizes=sizes)
        else:
            if (bucket, s3) not in _HANDLERS:
                _HANDLERS[(bucket, s3)] = DeltaStorageHandler(f"s3://{bucket}",
                                                              s3.storage_options())
            handlers[bucket] = _HANDLERS[(bucket, s3)]

    def one(item) -> bytes | None:
        (bucket, key), _ = item
        try:
            with handlers[bucket].open_input_file(key) as fh:
                return fh.read()
        except FileNotFoundError:
            return None
    return list(concurrently(one, split))


@dataclass(frozen=True)
class _Stat:
    st_size: int
    st_mtime: float


class S3Path:
    """The part of `pathlib.Path` the relay uses on table paths, over pyarrow's S3 file
    system: `/`, name, parent, exists, iterdir, read and write whole objects, unlink. It has
    no `__fspath__` on purpose: a local-only call (os.open, fsync, link) fails loudly."""

    def __init__(self, uri: str, fs, location: S3Location, known_type=None):
        self._key = uri[len("s3://"):].strip("/")
        self._fs = fs
        self.location = location
        self._known_type = known_type      # from a listing: saves a request per is_dir

    def _child(self, key: str, known_type=None) -> "S3Path":
        return S3Path(f"s3://{key}", self._fs, self.location, known_type)

    def __truediv__(self, part: str) -> "S3Path":
        return self._child(f"{self._key}/{str(part).strip('/')}")

    def __str__(self) -> str:
        return f"s3://{self._key}"

    __repr__ = __str__

    def __eq__(self, other) -> bool:
        return isinstance(other, S3Path) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __lt__(self, other: "S3Path") -> bool:
        return self._key < other._key

    def _listing(self, recursive: bool) -> list:
        """pyarrow FileInfos under this prefix (one LIST), empty if there is nothing."""
        from pyarrow import fs as pafs
        try:
            return self._fs.get_file_info(pafs.FileSelector(self._key, recursive=recursive))
        except FileNotFoundError:
            return []

    def rglob(self, pattern: str):
        """Every object under this prefix whose name matches `pattern` (fnmatch)."""
        import fnmatch
        return iter([self._child(i.path, i.type) for i in self._listing(recursive=True)
                     if fnmatch.fnmatch(i.path.rsplit("/", 1)[-1], pattern)])

    def sizes(self) -> dict[str, int]:
        """Name -> bytes of each object right under this prefix (one LIST)."""
        from pyarrow import fs as pafs
        return {i.path.rsplit("/", 1)[-1]: i.size or 0 for i in self._listing(recursive=False)
                if i.type == pafs.FileType.File}

    def total_size(self) -> int:
        """Bytes of every object under this prefix (one recursive LIST)."""
        from pyarrow import fs as pafs
        return sum(i.size or 0 for i in self._listing(recursive=True)
                   if i.type == pafs.FileType.File)

    @property
    def name(self) -> str:
        return self._key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "S3Path":
        return self._child(self._key.rsplit("/", 1)[0])

    def resolve(self) -> "S3Path":
        return self

    def _info(self):
        return self._fs.get_file_info(self._key)

    def exists(self) -> bool:
        from pyarrow import fs as pafs
        return self._info().type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        from pyarrow import fs as pafs
        kind = self._known_type if self._known_type is not None else self._info().type
        return kind == pafs.FileType.Directory

    def is_file(self) -> bool:
        from pyarrow import fs as pafs
        return self._info().type == pafs.FileType.File

    def iterdir(self):
        return iter([self._child(i.path, i.type) for i in self._listing(recursive=False)])

    def listdir(self) -> list[str]:
        return [p.name for p in self.iterdir()]

    def stat(self) -> _Stat:
        from pyarrow import fs as pafs
        info = self._info()
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(str(self))
        mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
        return _Stat(info.size or 0, mtime)

    def read_bytes(self) -> bytes:
        with self._fs.open_input_stream(self._key) as fh:
            return fh.read()

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)

    def write_bytes(self, data: bytes) -> None:
        """One PUT: readers see the old object or the new one, never a part."""
        with self._fs.open_output_stream(self._key) as fh:
            fh.write(data)

    def write_text(self, text: str, encoding: str = "utf-8") -> None:
        self.write_bytes(text.encode(encoding))

    def mkdir(self, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
        """Object stores have no directories: nothing to create."""

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self._fs.delete_file(self._key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self) -> None:
        try:
            self._fs.delete_dir(self._key)
        except FileNotFoundError:
            pass


def as_path(path):
    """A table path as given (S3Path) or as a local Path (from a str or PathLike)."""
    return path if is_remote(path) else Path(path)


def listdir(path) -> list[str]:
    """`os.listdir` for a local or an S3 directory (FileNotFoundError if absent)."""
    if is_remote(path):
        names = path.listdir()
        if not names and not path.exists():
            raise FileNotFoundError(str(path))
        return names
    return os.listdir(path)


def rmtree(path) -> None:
    if is_remote(path):
        path.rmtree()
    else:
        import shutil
        shutil.rmtree(path, ignore_errors=True)


def disk_usage(root) -> int:
    """Bytes of every file under a local directory or S3 prefix (what `relay status` and
    compaction report as the tables' size)."""
    if is_remote(root):
        return root.total_size()
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:  # removed by a concurrent writer or vacuum
                pass
    return total
