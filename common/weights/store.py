"""The weight store: versioned HF-format directories that vLLM reloads in place.

Layout (a directory on local or shared storage):

    <root>/v00000007/model.safetensors   the policy weights (HF names)
    <root>/v00000007/config.json ...     copied from the base model dir
    <root>/v00000007/manifest.json       {version, sha256, bytes, created_at}

A version is written under a temporary name, every file fsynced, then renamed:
a reader never sees a half-written version. The consumer announces it on
`rlstream.policy` (common/control/messages.py `PolicyAnnouncement`); producers call
`verify()` (size and sha256 of model.safetensors) before reloading. The store
keeps the newest `keep` versions.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from rlstream.common.errors import WeightStoreError
from rlstream.common.fsutil import commit_dir, staging_dir

WEIGHTS_FILE = "model.safetensors"
MANIFEST = "manifest.json"
# Files of the base model directory that make a version loadable on its own.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "rlstream_tiny_spec.json")


def sha256_file(path: str | os.PathLike, chunk: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def version_dirname(version: int) -> str:
    return f"v{version:08d}"


class WeightStore:
    """Write, verify and prune weight versions under `root`."""

    def __init__(self, root: str | os.PathLike, keep: int = 3):
        self.root = Path(root)
        self.keep = max(1, keep)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, version: int) -> Path:
        return self.root / version_dirname(version)

    def versions(self) -> list[int]:
        out = []
        for p in self.root.glob("v*"):
            if p.is_dir() and (p / MANIFEST).exists() and p.name[1:].isdigit():
                out.append(int(p.name[1:]))
        return sorted(out)

    def write(self, version: int, tensors: dict, base_dir: str | os.PathLike) -> dict:
        """Write `tensors` (name -> torch.Tensor, HF names) as version `version`.

        Returns the manifest: {version, uri, sha256, bytes, created_at}.
        """
        from safetensors.torch import save_file

        final = self.path(version)
        tmp = staging_dir(final)
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                  str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for name in SIDE_FILES:
            src = Path(base_dir) / name
            if src.exists():
                shutil.copyfile(src, tmp / name)
        manifest = {
            "version": version, "uri": final.resolve().as_uri(),
            "sha256": sha256_file(tmp / WEIGHTS_FILE),
            "bytes": (tmp / WEIGHTS_FILE).stat().st_size, "created_at": time.time(),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        commit_dir(tmp, final)
        self.prune()
        return manifest

    def prune(self) -> list[int]:
        """Delete all but the newest `keep` versions; return the deleted ones."""
        vs = self.versions()
        gone = vs[:-self.keep] if len(vs) > self.keep else []
        for v in gone:
            shutil.rmtree(self.path(v), ignore_errors=True)
        return gone


def uri_to_path(uri: str) -> Path:
    if uri.startswith("file://"):
        return Path(uri[len("file://"):])
    if "://" in uri:
        raise WeightStoreError(f"unsupported weight uri scheme in {uri!r} (only file:// is built in)")
    return Path(uri)


def stage_version(uri: str, dest: str | os.PathLike) -> Path:
    """Pin a version for loading: hard-link (copy across file systems) its files into `dest`.

    The weight store prunes old versions; a reader that loads from its own
    staged links cannot lose files halfway through a load, and verifying the
    staged copy checks exactly the bytes that are loaded.
    """
    src, out = uri_to_path(uri), Path(dest)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        for f in src.iterdir():
            try:
                os.link(f, out / f.name)
            except OSError:
                shutil.copyfile(f, out / f.name)
    except FileNotFoundError as e:
        raise WeightStoreError(f"version at {uri} vanished while staging ({e}); keeping the current weights") from None
    return out


def vouched(uri: str, root: str | os.PathLike, version: int, sha256: str, nbytes: int) -> Path:
    """The version directory `uri` names, if it is a version of the store at `root` whose
    manifest (written by the trainer with the weights) names this version, digest and size.
    An announcement is a Kafka message: one naming a directory elsewhere, or another version's
    bytes, is refused (WeightStoreError) before anything is read from it."""
    d, store = uri_to_path(uri).resolve(), Path(root).resolve()
    if d.parent != store or not d.name.startswith("v"):
        raise WeightStoreError(f"{uri} is not a version directory of the weight store {store} "
                               "(consumer.weight_store_dir); refusing it")
    try:
        m = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise WeightStoreError(f"{d} has no readable {MANIFEST} ({e}); refusing it") from None
    if (m.get("version"), m.get("sha256"), m.get("bytes")) != (version, sha256, nbytes):
        raise WeightStoreError(f"{d}: the store's manifest names version {m.get('version')} "
                               f"({str(m.get('sha256'))[:12]}..., {m.get('bytes')} bytes), the announcement "
                               f"version {version} ({sha256[:12]}..., {nbytes} bytes); refusing it")
    return d


def verify(uri: str, sha256: str, nbytes: int) -> Path:
    """Check that the version at `uri` is complete and untampered; return its dir.

    Raises WeightStoreError (what failed, and that the old weights stay in use).
    """
    d = uri_to_path(uri)
    f = d / WEIGHTS_FILE
    if not f.is_file():
        raise WeightStoreError(f"{f} is missing; keeping the current weights")
    size = f.stat().st_size
    if size != nbytes:
        raise WeightStoreError(f"{f} has {size} bytes, announced {nbytes}; keeping the current weights")
    got = sha256_file(f)
    if got != sha256:
        raise WeightStoreError(f"{f} sha256 {got[:12]}... != announced {sha256[:12]}...; keeping the current weights")
    return d
