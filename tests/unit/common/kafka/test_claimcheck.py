"""Choosing the claim-check store from `kafka.blob_dir` (the store itself is tested in
tests/integration/test_kafka_roundtrip.py)."""
import pytest

from common.errors import ConfigError
from common.kafka.claimcheck import BlobStore, open_blob_store


def test_open_blob_store_takes_a_directory_or_a_file_url_and_names_the_setting_otherwise(tmp_path):
    assert open_blob_store(tmp_path).root == tmp_path
    from_url = open_blob_store(tmp_path.as_uri())
    assert isinstance(from_url, BlobStore) and from_url.root == tmp_path
    with pytest.raises(ConfigError) as e:
        open_blob_store("s3://bucket/blobs")
    assert e.value.key == "kafka.blob_dir" and "s3://bucket/blobs" in str(e.value)
