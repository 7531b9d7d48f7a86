"""Config loading: defaults, file, env, --set precedence; errors name the key."""
from pathlib import Path

import pytest

from rlstream.common.config import dump_config, load_config
from rlstream.common.errors import ConfigError

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


# ------------------------------------------------------ declared environment variables

def test_env_aliases_precedence_default_file_alias_generic_set_flag(tmp_path):
    """default < file < declared alias < RLSTREAM__SECTION__KEY < --set < dedicated flag."""
    f = tmp_path / "c.yaml"
    f.write_text("producer: {http: {admin_token: from-file}}\ncli: {log_level: warning}\n")
    assert load_config(None, environ={}).producer.http.admin_token is None
    assert load_config(f, environ={}).producer.http.admin_token == "from-file"
    env = {"RLSTREAM_ADMIN_TOKEN": "from-alias"}
    cfg = load_config(f, environ=env)
    assert (cfg.producer.http.admin_token, cfg.consumer.http.admin_token, cfg.cli.admin_token) == ("from-alias",) * 3
    env["RLSTREAM__PRODUCER__HTTP__ADMIN_TOKEN"] = "from-generic"
    cfg = load_config(f, environ=env)
    assert (cfg.producer.http.admin_token, cfg.consumer.http.admin_token) == ("from-generic", "from-alias")
    cfg = load_config(f, ["producer.http.admin_token=from-set"], environ=env)
    assert cfg.producer.http.admin_token == "from-set"
    assert load_config(f, ["cli.log_level=error"], environ={"RLSTREAM_LOG_LEVEL": "debug"},
                       flags={"cli.log_level": "critical"}).cli.log_level == "CRITICAL"
    assert load_config(f, ["cli.log_level=error"], environ={"RLSTREAM_LOG_LEVEL": "debug"},
                       flags={"cli.log_level": None}).cli.log_level == "ERROR"
    assert load_config(f, environ={"RLSTREAM_LOG_LEVEL": "debug"}).cli.log_level == "DEBUG"
    assert load_config(f, environ={}).cli.log_level == "WARNING"


def test_env_alias_values_are_taken_verbatim_and_empty_is_unset():
    cfg = load_config(None, environ={"RLSTREAM_ADMIN_TOKEN": "0123", "RLSTREAM_ADMIN_URL": "http://c:8082"})
    assert cfg.cli.admin_token == "0123" and cfg.producer.http.admin_token == "0123"  # not the number 123
    assert cfg.cli.admin_url == "http://c:8082"
    assert load_config(None, environ={"RLSTREAM_ADMIN_TOKEN": ""}).producer.http.admin_token is None


def test_log_level_takes_the_names_logging_takes():
    for given, want in [("debug", "DEBUG"), (" Info ", "INFO"), ("warn", "WARNING"), ("fatal", "CRITICAL")]:
        assert load_config(None, environ={"RLSTREAM_LOG_LEVEL": given}).cli.log_level == want


def test_a_bad_alias_value_names_the_setting():
    with pytest.raises(ConfigError) as e:
        load_config(None, environ={"RLSTREAM_LOG_LEVEL": "chatty"})
    assert e.value.key == "cli.log_level"


def test_dry_run_shows_resolved_aliases_with_secrets_masked():
    import yaml

    cfg = load_config(None, environ={"RLSTREAM_ADMIN_TOKEN": "t0k3n", "RLSTREAM_LOG_LEVEL": "debug"})
    out = dump_config(cfg)
    data = yaml.safe_load(out)
    assert "t0k3n" not in out
    assert data["producer"]["http"]["admin_token"] == data["consumer"]["http"]["admin_token"] == "***"
    assert data["cli"] == {"log_level": "DEBUG", "admin_url": "http://127.0.0.1:8081", "admin_token": "***"}


def test_every_rlstream_environment_variable_is_declared():
    """Runtime code and ops/ use no RLSTREAM_* variable that ENV_ALIASES does not declare (the generic
    RLSTREAM__SECTION__KEY form maps onto settings by construction; the harness owns its own knobs)."""
    import re

    from rlstream.common.config import ENV_ALIASES, RlstreamConfig

    def names(paths):
        return {m for p in paths for m in re.findall(r"\bRLSTREAM_[A-Z][A-Z_]*[A-Z]\b", p.read_text(errors="replace"))}

    root = CONFIGS[0].parents[1]
    declared = {a.name for a in ENV_ALIASES}
    runtime = names(p for pkg in ("common", "producer", "consumer") for p in (root / pkg).rglob("*.py")
                    if "harness" not in p.parts)
    assert runtime and runtime <= declared, sorted(runtime - declared)
    compose_only = {"RLSTREAM_CONFIG"}  # compose's own variable: the file its shell commands pass to -c
    deployed = names(p for p in (root / "ops").rglob("*") if p.is_file())
    assert deployed <= declared | compose_only, sorted(deployed - declared - compose_only)
    for a in ENV_ALIASES:  # every alias names settings that exist
        for key in a.keys:
            section, *rest = key.split(".")
            model = RlstreamConfig.model_fields[section].annotation
            for name in rest[:-1]:
                model = model.model_fields[name].annotation
            assert rest[-1] in model.model_fields, key


def test_the_control_settings_are_one_model_for_the_file_and_the_control_plane():
    from rlstream.common.config import ControlSettings, StalenessSettings
    from rlstream.common.control.messages import CONTROL_KEYS, parse_control_value

    assert issubclass(StalenessSettings, ControlSettings) and CONTROL_KEYS == tuple(ControlSettings.model_fields)
    # and `auto`: the limits of `max_staleness: auto`, file-only (the controller's bound is max_staleness)
    assert set(StalenessSettings.model_fields) == set(ControlSettings.model_fields) | {"auto"}
    for key, value in [("max_staleness", 1001), ("max_staleness", -1), ("mode", "sometimes"), ("decay", 0),
                       ("decay", 1.5), ("paused", "maybe")]:
        with pytest.raises(ConfigError) as file_err:
            load_config(None, [f"staleness.{key}={value}"], environ={})
        with pytest.raises(ConfigError) as ctl_err:
            parse_control_value(key, value)
        assert file_err.value.key == f"staleness.{key}" and ctl_err.value.key == key
    cfg = load_config(None, ["staleness.max_staleness=5", "staleness.paused=true"], environ={})
    start = ControlSettings.from_settings(cfg.staleness)
    assert type(start) is ControlSettings and start.model_dump() == {"max_staleness": 5, "mode": "drop",
                                                                      "decay": 1.0, "paused": True,
                                                                      "max_staleness_auto": False}
    start.max_staleness = 0
    assert cfg.staleness.max_staleness == 5, "a service's runtime copy is its own"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_passes_dry_run(path):
    """What an operator runs first: `rlstream consumer --dry-run -c configs/X.yaml` exits 0
    and prints the resolved config (both roles' sections; the producer loads the same
    model), with no engine, trainer or broker started."""
    import os
    import subprocess
    import sys

    root = CONFIGS[0].parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM")}
    env["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, "-m", "rlstream.cli", "consumer", "--dry-run", "-c", str(path)],
                         cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "consumer:" in out.stdout and "producer:" in out.stdout

def test_dynamic_sampling_resolves_auto_and_refuses_groups_of_one():
    cfg = load_config(None, environ={})
    assert cfg.consumer.dynamic_sampling == "auto" and cfg.consumer.filters_zero_variance
    for loss in ("minirl", "minirl_no_is", "minirl_length_norm", "grpo", "cispo"):
        assert load_config(None, [f"consumer.loss.name={loss}"], environ={}).consumer.filters_zero_variance
    assert not load_config(None, ["consumer.dynamic_sampling=off"], environ={}).consumer.filters_zero_variance
    assert load_config(None, ["consumer.dynamic_sampling=on"], environ={}).consumer.filters_zero_variance
    one = ["producer.group_size=1", "consumer.group_size=1"]
    assert not load_config(None, one, environ={}).consumer.filters_zero_variance  # auto: nothing to compare
    with pytest.raises(ConfigError, match="never has reward variance") as e:
        load_config(None, one + ["consumer.dynamic_sampling=on"], environ={})
    assert e.value.key == "consumer.dynamic_sampling"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["consumer.dynamic_sampling=sometimes"], environ={})
    assert e.value.key == "consumer.dynamic_sampling"


def test_a_bare_off_for_routing_is_off_not_a_boolean_error(tmp_path):
    # YAML 1.1 reads `routing: off` (a ConfigMap, --set, an env value) as false; found on the k8s twin
    path = tmp_path / "c.yaml"
    path.write_text("producer:\n  engine:\n    routing: off\n")
    assert load_config(str(path), environ={}).producer.engine.routing == "off"
    assert load_config(None, ["producer.engine.routing=off"], environ={}).producer.engine.routing == "off"
