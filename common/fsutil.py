"""Crash-safe directory writes, shared by the weight store and checkpoints.

    tmp = staging_dir(final)        # <parent>/.<name>.tmp-<pid>, empty
    ... write files into tmp ...
    commit_dir(tmp, final)          # fsync files + dir, rename, fsync parent

A reader that only trusts directories with their completion marker (the
weight store's manifest.json, a checkpoint's state.json) never sees a
half-written one.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_dir(final: Path) -> Path:
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit_dir(tmp: Path, final: Path) -> Path:
    """Make `tmp` durable and rename it to `final` (replacing an older `final`)."""
    for f in tmp.iterdir():
        fsync_path(f)
    fsync_path(tmp)
    if final.exists():  # a retried write of the same name replaces it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(final.parent)
    return final
