"""Choosing the claim-check store from `kafka.blob_dir` (the store itself is tested in
tests/integration/test_kafka_roundtrip.py)."""
import pytest

from rlstream.common.errors import ConfigError
from rlstream.common.kafka.claimcheck import BlobStore, open_blob_store


def test_open_blob_store_takes_a_directory_or_a_file_url_and_names_the_setting_otherwise(tmp_path):
    assert open_blob_store(tmp_path).root == tmp_path
    from_url = open_blob_store(tmp_path.as_uri())
    assert isinstance(from_url, BlobStore) and from_url.root == tmp_path
    with pytest.raises(ConfigError) as e:
        open_blob_store("s3://bucket/blobs")
    assert e.value.key == "kafka.blob_dir" and "s3://bucket/blobs" in str(e.value)


# ---------------------------------------------------------------- links planted inside the store

def _secret(tmp_path):
    import hashlib

    outside = tmp_path / "outside"
    outside.mkdir()
    data = b"not a blob of this store: a file elsewhere on the machine"
    sha = hashlib.sha256(data).hexdigest()
    (outside / sha).write_bytes(data)
    return outside, data, sha


def test_a_symlinked_blob_is_refused(tmp_path):
    """A link planted at a blob's path (pointing anywhere, even at the right bytes) is not followed."""
    from rlstream.common.errors import InvalidRecordError

    outside, data, sha = _secret(tmp_path)
    store = BlobStore(tmp_path / "blobs")
    (store.root / sha[:2]).mkdir(parents=True)
    (store.root / sha[:2] / sha).symlink_to(outside / sha)
    with pytest.raises(InvalidRecordError) as e:
        store.get((store.root / sha[:2] / sha).as_uri(), sha, len(data))
    assert e.value.field == "claim_check" and "link" in e.value.reason
    # put replaces the planted link by the blob itself; the file it pointed at is untouched
    uri, got_sha, n = store.put(data)
    assert got_sha == sha and not (store.root / sha[:2] / sha).is_symlink()
    assert store.get(uri, sha, n) == data and (outside / sha).read_bytes() == data


def test_a_symlinked_blob_directory_is_refused(tmp_path):
    from rlstream.common.errors import BlobStoreError, InvalidRecordError

    outside, data, sha = _secret(tmp_path)
    store = BlobStore(tmp_path / "blobs")
    store.root.mkdir()
    (store.root / sha[:2]).symlink_to(outside, target_is_directory=True)  # <root>/ab -> /elsewhere
    with pytest.raises(InvalidRecordError) as e:
        store.get((store.root / sha[:2] / sha).as_uri(), sha, len(data))
    assert e.value.field == "claim_check" and "link" in e.value.reason
    with pytest.raises(BlobStoreError, match="link"):
        store.put(data)


def test_a_store_root_reached_through_a_link_still_works(tmp_path):
    """blob_dir itself may be a link (a shared mount): only links inside the store are refused."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "via-link").symlink_to(real, target_is_directory=True)
    store = BlobStore(tmp_path / "via-link")
    uri, sha, n = store.put(b"payload")
    assert store.get(uri, sha, n) == b"payload" and (real / sha[:2] / sha).is_file()
