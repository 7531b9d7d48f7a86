"""The collective path's wire format (common/weights/wire.py): pure functions, no network."""
from __future__ import annotations

import pytest
import torch

from rlstream.common.errors import DigestMismatchError, WeightTransferError
from rlstream.common.weights import wire


def tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(7, 5, generator=g),
            "b.weight": torch.randn(5, 7, generator=g).t(),  # not contiguous
            "c.weight": torch.randn(3, generator=g).bfloat16(),
            "d.idx": torch.arange(4, dtype=torch.int64)}


def spec_of(ts: dict) -> wire.GroupSpec:
    return wire.GroupSpec.of(list(ts), [t.dtype for t in ts.values()], [tuple(t.shape) for t in ts.values()])


def test_pack_then_unpack_is_exact_for_every_dtype_and_layout():
    ts = tensors()
    spec = spec_of(ts)
    buf = wire.pack(list(ts.values()))
    assert buf.dtype == torch.uint8 and buf.numel() == spec.nbytes == sum(t.numel() * t.element_size() for t in ts.values())
    back = dict(wire.unpack(buf, spec))
    assert list(back) == list(ts)
    for k, t in ts.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t)


def test_pack_reuses_a_buffer_of_the_right_size_and_views_share_it():
    ts = list(tensors().values())
    first = wire.pack(ts)
    again = wire.pack(ts, out=first)
    assert again.data_ptr() == first.data_ptr()
    other = wire.pack(ts[:1], out=first)  # wrong size: a new buffer
    assert other.data_ptr() != first.data_ptr()
    same = {"a": torch.randn(3, 4), "b": torch.randn(5)}  # one dtype, as in a model's group: aligned views
    buf = wire.pack(list(same.values()))
    views = wire.unpack(buf, spec_of(same))
    buf.zero_()
    assert all(float(v.abs().sum()) == 0 for _, v in views)  # no copy on unpack


def test_header_round_trips_and_malformed_ones_name_the_problem():
    h = wire.VersionHeader(7, [spec_of(tensors()), spec_of({"x": torch.zeros(2, 2)})])
    back = wire.VersionHeader.decode(h.encode())
    assert back == h and back.nbytes == h.nbytes
    for raw in (b"not json", b'{"version": 1}', b'{"version": 1, "algo": "blake3", "groups": '
                b'[{"names": ["a"], "dtypes": ["float32", "float32"], "shapes": [[1]]}]}',
                b'{"version": 1, "algo": "blake3", "groups": [{"names": ["a"], "dtypes": ["pickle"], "shapes": [[1]]}]}'):
        with pytest.raises(WeightTransferError, match="malformed version header"):
            wire.VersionHeader.decode(raw)
    with pytest.raises(WeightTransferError, match="md5"):
        wire.VersionHeader.decode(wire.VersionHeader(1, [], algo="md5").encode())


def test_digests_detect_one_flipped_byte_and_the_version_digest_binds_the_groups():
    buf = wire.pack(list(tensors().values()))
    d = wire.digest(buf)
    assert len(d) == wire.DIGEST_BYTES and wire.digest(buf.clone()) == d
    bad = buf.clone()
    bad[bad.numel() // 2] ^= 0xFF
    assert wire.digest(bad) != d
    spec = spec_of(tensors())
    with pytest.raises(DigestMismatchError, match="group 1 .a.weight"):
        wire.check_group(1, spec, wire.digest(bad), d, version=3)
    v = wire.version_digest([d, d])
    assert v != wire.version_digest([d]) and v != wire.version_digest([d, wire.digest(bad)])
    wire.check_version(3, v, v)
    with pytest.raises(DigestMismatchError, match="streamed"):
        wire.check_version(3, v, wire.version_digest([d]))


def test_a_buffer_of_the_wrong_size_is_refused():
    with pytest.raises(WeightTransferError, match="bytes"):
        wire.unpack(torch.zeros(3, dtype=torch.uint8), spec_of(tensors()))
