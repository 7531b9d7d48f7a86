"""Claim-check blob store: where records too large for a Kafka message live.

A record above `kafka.claim_check_bytes` is written here and a small pointer
(`common.record.ClaimPointer`: uri, sha256, bytes) goes on Kafka instead.

Layout: content-addressed by sha256, `<root>/<sha[:2]>/<sha>`; writes are
atomic (temporary file in the same directory, fsync, rename, fsync of the
directory), so a reader never sees a partial blob and writing the same bytes
twice is a no-op. URIs are `file://<absolute path>`.

Reading locates the blob by its digest under the reader's own root (the URI's
last path component must be the digest), so producers and consumers may mount
a shared directory at different paths, and a hostile pointer cannot make the
reader open arbitrary files. Size and sha256 are both verified; any mismatch
or absence raises `InvalidRecordError("claim_check", ...)`, which the reader
routes to the DLQ.

Seam for object storage: `AbstractBlobStore` is the interface, `BlobStore` the
directory implementation; `open_blob_store(url)`
picks the implementation by scheme (only `file` exists today; an `s3://`
store would implement put/get the same way).

Garbage collection of blobs whose records were trained is not done here yet
(see docs/kafka.md).
"""
from __future__ import annotations

import abc
import hashlib
import os
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

from common.errors import ConfigError, InvalidRecordError


class AbstractBlobStore(abc.ABC):
    """Interface: put bytes, get them back verified. Implementations are thread-safe."""

    scheme = ""

    @abc.abstractmethod
    def put(self, data: bytes) -> tuple[str, str, int]:
        """Store `data`; returns (uri, sha256 hex, nbytes)."""

    @abc.abstractmethod
    def get(self, uri: str, sha256: str, nbytes: int) -> bytes:
        """The bytes at `uri`, verified against sha256 and nbytes."""


class BlobStore(AbstractBlobStore):
    """Directory-backed, content-addressed store (local disk or a shared mount)."""

    scheme = "file"

    def __init__(self, root: str | os.PathLike, max_blob_bytes: int = 1 << 31):
        self.root = Path(root).absolute()
        self.max_blob_bytes = max_blob_bytes

    def _path(self, sha: str) -> Path:
        return self.root / sha[:2] / sha

    def put(self, data: bytes) -> tuple[str, str, int]:
        sha = hashlib.sha256(data).hexdigest()
        path = self._path(sha)
        n = len(data)
        if not (path.is_file() and path.stat().st_size == n):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{sha[:16]}.", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        return path.as_uri(), sha, n

    def get(self, uri: str, sha256: str, nbytes: int) -> bytes:
        u = urlparse(uri)
        if u.scheme != self.scheme:
            raise InvalidRecordError("claim_check", f"unsupported blob uri scheme {u.scheme!r} (this store: file)")
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise InvalidRecordError("claim_check", "sha256 must be 64 lowercase hex characters")
        if unquote(u.path).rsplit("/", 1)[-1] != sha256:
            raise InvalidRecordError("claim_check", f"uri {uri!r} does not name blob {sha256}")
        if not 0 < nbytes <= self.max_blob_bytes:
            raise InvalidRecordError("claim_check", f"blob size {nbytes} out of range")
        path = self._path(sha256)
        try:
            size = path.stat().st_size
            if size != nbytes:
                raise InvalidRecordError("claim_check", f"blob {sha256[:12]} has {size} bytes, pointer says {nbytes}")
            data = path.read_bytes()
        except FileNotFoundError:
            raise InvalidRecordError("claim_check", f"blob {sha256[:12]} not found under {self.root} "
                                     "(is kafka.blob_dir the same shared directory as the producer's?)") from None
        except OSError as e:
            raise InvalidRecordError("claim_check", f"blob {sha256[:12]} unreadable: {e}") from None
        if len(data) != nbytes or hashlib.sha256(data).hexdigest() != sha256:
            raise InvalidRecordError("claim_check", f"blob {sha256[:12]} fails its sha256/size check (corrupt)")
        return data


def open_blob_store(url_or_dir: str | os.PathLike) -> AbstractBlobStore:
    """A store for `kafka.blob_dir`: a directory path or a `file://` URL."""
    s = str(url_or_dir)
    u = urlparse(s)
    if u.scheme in ("", "file"):
        return BlobStore(unquote(u.path) if u.scheme == "file" else s)
    raise ConfigError(f"unsupported blob store {s!r}: only a directory or a file:// URL is implemented",
                      key="kafka.blob_dir")
