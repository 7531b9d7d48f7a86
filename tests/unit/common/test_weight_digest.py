"""The device fold digest of the nccl path (common/weights/digest.py): what its docstring says
it detects, on CPU tensors (the GPU path calls the same function on CUDA tensors)."""
from __future__ import annotations

import torch

from rlstream.common.weights import digest as digest_mod
from rlstream.common.weights.digest import fold_digest

TENSORS = [("embed", torch.randn(64, 33, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)),
           ("norm", torch.randn(33, generator=torch.Generator().manual_seed(1))),
           ("odd", torch.arange(7, dtype=torch.uint8))]  # 7 bytes: folded as bytes, not words


def with_byte_flipped(i: int, pos: int, bit: int = 0):
    out = [(n, t.clone()) for n, t in TENSORS]
    out[i][1].view(-1).view(torch.uint8)[pos] ^= 1 << bit
    return out


def test_equal_bytes_give_equal_digests_and_every_single_bit_flip_changes_it():
    d = fold_digest(TENSORS)
    assert d == fold_digest([(n, t.clone()) for n, t in TENSORS])
    for i, (_, t) in enumerate(TENSORS):
        nbytes = t.numel() * t.element_size()
        for pos in (0, 1, nbytes // 2, nbytes - 1):
            for bit in (0, 7):
                assert fold_digest(with_byte_flipped(i, pos, bit)) != d, (i, pos, bit)


def test_order_names_truncation_and_swapped_words_change_it():
    d = fold_digest(TENSORS)
    assert fold_digest(TENSORS[::-1]) != d  # groups delivered in another order
    assert fold_digest([("other", TENSORS[0][1])] + TENSORS[1:]) != d
    assert fold_digest([(TENSORS[0][0], TENSORS[0][1][:-1])] + TENSORS[1:]) != d  # truncated
    swapped = TENSORS[1][1].clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert fold_digest([TENSORS[0], ("norm", swapped), TENSORS[2]]) != d


def test_chunking_and_unaligned_views_fold_the_same_bytes(monkeypatch):
    big = torch.randn(1000)
    whole = fold_digest([("x", big)])
    monkeypatch.setattr(digest_mod, "_CHUNK_WORDS", 64)  # many chunks: position weights continue across them
    assert fold_digest([("x", big)]) == whole
    half = torch.randn(9, dtype=torch.bfloat16)
    assert fold_digest([("h", half[1:])]) == fold_digest([("h", half[1:].clone())])  # odd byte offset
