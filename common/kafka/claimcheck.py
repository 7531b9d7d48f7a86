"""Claim-check blob store: where records too large for a Kafka message live.

A record above `kafka.claim_check_bytes` is written here and a small pointer
(`rlstream.common.record.ClaimPointer`: uri, sha256, bytes) goes on Kafka instead.

Layout: content-addressed by sha256, `<root>/<sha[:2]>/<sha>`; writes are
atomic (temporary file in the same directory, fsync, rename, fsync of the
directory), so a reader never sees a partial blob and writing the same bytes
twice is a no-op. URIs are `file://<absolute path>`.

Reading locates the blob by its digest under the reader's own root (the URI's
last path component must be the digest), so producers and consumers may mount
a shared directory at different paths, and a hostile pointer cannot make the
reader open arbitrary files. Nor can something planted inside the store: the
blob and its `<sha[:2]>` directory must be a regular file and a directory,
not symbolic links, and must resolve inside the root (the file is opened with
O_NOFOLLOW and checked on the open descriptor). Size and sha256 are both
verified; any mismatch, link or absence raises
`InvalidRecordError("claim_check", ...)`, which the reader routes to the DLQ.
`put` refuses a linked `<sha[:2]>` directory too (BlobStoreError), and
replaces a link planted at a blob's path by the blob.

Seam for object storage: `AbstractBlobStore` is the interface, `BlobStore` the
directory implementation; `open_blob_store(url)`
picks the implementation by scheme (only `file` exists today; an `s3://`
store would implement put/get the same way).

Listing and deleting (`BlobStore.blobs`, `delete`) are for the garbage
collector (common/kafka/blobgc.py), which deletes only blobs no retained record
points to. `put` of bytes already stored refreshes the blob's mtime, so a
publisher retry of an old record cannot lose its blob to the collector's
age grace. `resolve` turns a message value (record or pointer) into the
rollout, for every reader of the topic.
"""
from __future__ import annotations

import abc
import hashlib
import os
import stat
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

from dataclasses import dataclass
from typing import Iterator

from rlstream.common.errors import BlobStoreError, ConfigError, InvalidRecordError
from rlstream.common.record import DEFAULT_LIMITS, ClaimPointer, RecordLimits, Rollout, decode, decode_any


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

    def _inside(self, directory: Path) -> bool:
        """`directory` is a real directory (no link) that resolves inside the root."""
        return not directory.is_symlink() and directory.resolve().is_relative_to(self.root.resolve())

    def put(self, data: bytes) -> tuple[str, str, int]:
        sha = hashlib.sha256(data).hexdigest()
        path = self._path(sha)
        n = len(data)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not self._inside(path.parent):
            raise BlobStoreError(f"{path.parent} is a link or leaves the store {self.root}; remove it "
                                 "(blob directories must be plain directories)")
        st = os.lstat(path) if os.path.lexists(path) else None
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == n:
            os.utime(path)  # stored again now: the collector's age grace starts over
        else:  # absent, or a planted link: (re)written
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
            data = self._read_regular(path, sha256, nbytes)
        except FileNotFoundError:
            raise InvalidRecordError("claim_check", f"blob {sha256[:12]} not found under {self.root} "
                                     "(is kafka.blob_dir the same shared directory as the producer's?)") from None
        except OSError as e:  # ELOOP: the blob is a symbolic link (O_NOFOLLOW)
            raise InvalidRecordError("claim_check", f"blob {sha256[:12]} unreadable or a link: {e}") from None
        if len(data) != nbytes or hashlib.sha256(data).hexdigest() != sha256:
            raise InvalidRecordError("claim_check", f"blob {sha256[:12]} fails its sha256/size check (corrupt)")
        return data

    def _read_regular(self, path: Path, sha256: str, nbytes: int) -> bytes:
        """The bytes of `path`, a regular file inside the store reached through no link."""
        if os.path.lexists(path.parent) and not self._inside(path.parent):
            raise InvalidRecordError("claim_check", f"blob directory {path.parent.name} is a link or leaves "
                                     f"the store {self.root}")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise InvalidRecordError("claim_check", f"blob {sha256[:12]} is not a regular file")
            if st.st_size != nbytes:
                raise InvalidRecordError("claim_check", f"blob {sha256[:12]} has {st.st_size} bytes, "
                                         f"pointer says {nbytes}")
            return f.read(nbytes + 1)


    def blobs(self) -> Iterator["BlobFile"]:
        """Every blob in the store (plain files named by their digest), and the temporary
        files a crashed `put` left (`temporary`: True). Links and foreign files are skipped."""
        if not self.root.is_dir():
            return
        for d in sorted(self.root.iterdir()):
            if len(d.name) != 2 or d.is_symlink() or not d.is_dir():
                continue
            for f in sorted(d.iterdir()):
                st = os.lstat(f)
                if not stat.S_ISREG(st.st_mode):
                    continue
                if _is_digest(f.name) and f.name[:2] == d.name:
                    yield BlobFile(f.name, f, st.st_size, st.st_mtime, False)
                elif f.name.startswith(".") and f.name.endswith(".tmp"):
                    yield BlobFile(f.name, f, st.st_size, st.st_mtime, True)

    def delete(self, blob: "BlobFile") -> None:
        """Remove one blob (or temporary file) listed by `blobs`; gone already is fine."""
        blob.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class BlobFile:
    name: str
    """The sha256 of a blob; the file name of a temporary file."""
    path: Path
    nbytes: int
    mtime: float
    temporary: bool


def _is_digest(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def resolve(value: bytes | None, blobs: AbstractBlobStore | None,
            limits: RecordLimits = DEFAULT_LIMITS) -> tuple[Rollout, ClaimPointer | None]:
    """A message value as its rollout, and the claim-check pointer it came through (None: inline).
    InvalidRecordError for anything undecodable, a blob that is gone or fails its check, or
    a blob holding another rollout than its pointer names (field `claim_check`)."""
    if value is None:
        raise InvalidRecordError("<bytes>", "empty message (null value)")
    out = decode_any(value, limits)
    if not isinstance(out, ClaimPointer):
        return out, None
    if blobs is None:
        raise InvalidRecordError("claim_check", f"is a claim check (blob {out.sha256[:12]}) and no blob "
                                 "store is configured (kafka.blob_dir)")
    r = decode(blobs.get(out.uri, out.sha256, out.nbytes), limits)
    if (r.rollout_id, r.group_id) != (out.rollout_id, out.group_id):
        raise InvalidRecordError("claim_check", f"blob holds rollout {r.rollout_id!r}/{r.group_id!r}, "
                                 f"pointer names {out.rollout_id!r}/{out.group_id!r}")
    return r, out


def open_blob_store(url_or_dir: str | os.PathLike) -> AbstractBlobStore:
    """A store for `kafka.blob_dir`: a directory path or a `file://` URL."""
    s = str(url_or_dir)
    u = urlparse(s)
    if u.scheme in ("", "file"):
        return BlobStore(unquote(u.path) if u.scheme == "file" else s)
    raise ConfigError(f"unsupported blob store {s!r}: only a directory or a file:// URL is implemented",
                      key="kafka.blob_dir")
