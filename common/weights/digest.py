"""A weight digest cheap enough for the GPU path, computed where the tensors are.

    fold = Fold()
    for name, t in tensors:          # on the trainer as each tensor is sent, on the
        fold.add(name, t)            # producer as each is received (same order)
    fold.hexdigest()                 # compared by the producer's Reloader before serving

blake3 (common/weights/wire.py) needs the bytes on the host; vLLM's `nccl`
engine receives into GPU memory and loads from there, so on that path the
bytes are folded on the device instead: each tensor's bytes are viewed as
int32 words (uint8 when their length is not a multiple of 4) and reduced to
two 64-bit sums, mod 2^64, in int64 on the tensor's own device:

    plain    = sum(w_i)
    weighted = sum(w_i * m_i)     m_i = (i * 0x9E3779B97F4A7C15) | 1, odd, per position

A few element-wise int64 ops over the words (chunked, so at most
`_CHUNK_WORDS` int64 temporaries at once): memory-bound on a GPU. Each
tensor's (name, dtype, shape, plain, weighted) then goes through blake3 on the
host, in the order the tensors came, so the digest covers their names, their
order and their lengths too.

What it detects, with certainty:
- any change confined to one 32-bit word (a flipped bit or byte, a bad word):
  the word's difference d is nonzero and below 2^32 in size, m_i is odd, so
  d * m_i != 0 mod 2^64;
- truncation or padding of a tensor (its shape is hashed; a short receive
  raises before), a tensor missing, added, renamed or retyped, tensors or
  groups delivered in another order (the per-tensor records are chained).
What it detects with high probability only: several words changed at once
(random corruption cancels out of both sums with a chance of the order of
2^-64), words swapped inside one tensor (the weighted sum changes unless
(a - b)(m_i - m_j) = 0 mod 2^64).
What it does not: an adversary who can write to the link can craft a change
that leaves both sums equal (they are linear); blake3 on the gloo path (and
the durable copy's sha256) cover that threat, this digest covers faults.
"""
from __future__ import annotations

import blake3
import torch

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64: int64 products wrap mod 2^64
_MASK = 2**64 - 1
_CHUNK_WORDS = 1 << 24  # 16 Mi words per step: 128 MiB of int64 temporaries at most


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat int32 (or uint8) view, no copy when contiguous and aligned."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() % 4:
        return flat
    if flat.storage_offset() % 4:  # a view at an odd offset cannot be reinterpreted in place
        flat = flat.clone()
    return flat.view(torch.int32)


def fold_tensor(t: torch.Tensor) -> torch.Tensor:
    """[plain, weighted]: the sums of `t`'s words mod 2^64, an int64 pair on `t`'s device
    (not synchronized: `Fold` reads every tensor's pair back at once)."""
    words = _words(t)
    sums = torch.zeros(2, dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        w = words[start:start + _CHUNK_WORDS].to(torch.int64)
        m = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device).mul_(_GOLDEN).bitwise_or_(1)
        sums[0] += w.sum()
        sums[1] += w.mul_(m).sum()
    return sums


class Fold:
    """The running digest of a sequence of named tensors (see the module docstring)."""

    algo = "fold64x2+blake3"

    def __init__(self):
        self._records: list[str] = []
        self._sums: list[torch.Tensor] = []  # one [plain, weighted] per tensor, on its device

    @property
    def tensors(self) -> int:
        return len(self._records)

    def add(self, name: str, t: torch.Tensor) -> None:
        self._records.append(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}")
        self._sums.append(fold_tensor(t))

    def hexdigest(self) -> str:
        """One device-to-host read for every tensor folded (a read per tensor would cost a
        synchronization each: thousands per version)."""
        h = blake3.blake3()
        sums = [s.cpu() for s in _stack_by_device(self._sums)]
        flat = [pair for block in sums for pair in block.tolist()]
        for record, (plain, weighted) in zip(self._records, flat):
            h.update(f"{record}|{plain & _MASK:016x}|{weighted & _MASK:016x}\n".encode())
        return h.hexdigest()


def _stack_by_device(sums: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive runs of pairs on one device, stacked (order kept)."""
    runs: list[list[torch.Tensor]] = []
    for s in sums:
        if runs and runs[-1][0].device == s.device:
            runs[-1].append(s)
        else:
            runs.append([s])
    return [torch.stack(run) for run in runs]


def fold_digest(tensors) -> str:
    """The digest of (name, tensor) pairs, in order."""
    fold = Fold()
    for name, t in tensors:
        fold.add(name, t)
    return fold.hexdigest()
