"""Config loading: defaults, file, env, --set precedence; errors name the key."""
from pathlib import Path

import pytest

from common.config import dump_config, load_config
from common.errors import ConfigError

CONFIGS = sorted(Path(__file__).resolve().parents[3].joinpath("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = load_config(path, environ={})
    assert cfg.producer.group_size == cfg.consumer.group_size


def test_precedence_file_env_cli(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("staleness: {max_staleness: 3}\nkafka: {bootstrap_servers: 'a:1'}\n")
    assert load_config(f, environ={}).staleness.max_staleness == 3
    env = {"RLSTREAM__STALENESS__MAX_STALENESS": "5"}
    assert load_config(f, environ=env).staleness.max_staleness == 5
    assert load_config(f, ["staleness.max_staleness=7"], environ=env).staleness.max_staleness == 7
    assert load_config(f, environ={}).kafka.bootstrap_servers == "a:1"


@pytest.mark.parametrize("override,key", [
    (["kafka.bootstrap_server=x"], "kafka.bootstrap_server"),
    (["consumer.optimizer.lr=-1"], "consumer.optimizer.lr"),
    (["staleness.mode=sometimes"], "staleness.mode"),
    (["staleness.decay=1.5"], "staleness.decay"),
    (["nosuchsection.x=1"], "nosuchsection"),
    (["kafka.topics.rollouts_partitions=0"], "kafka.topics.rollouts_partitions"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, override, environ={})
    assert e.value.key == key and key in str(e.value)


def test_unknown_env_key_is_refused():
    with pytest.raises(ConfigError, match="producer.typo"):
        load_config(None, environ={"RLSTREAM__PRODUCER__TYPO": "1"})


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="group_size"):
        load_config(None, ["producer.group_size=4", "consumer.group_size=8"], environ={})
    with pytest.raises(ConfigError, match="sasl_mechanism"):
        load_config(None, ["kafka.security_protocol=SASL_SSL"], environ={})


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("kafka: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_dry_run_dump_masks_secrets():
    cfg = load_config(None, ["producer.http.admin_token=s3cret", "kafka.sasl_plain_password=pw"], environ={})
    out = dump_config(cfg)
    assert "s3cret" not in out and "pw\n" not in out and "***" in out
