"""The `consumer` section of common/config/consumer.py: bounds and cross-field checks
refused at load time (by `--dry-run` too), and every error key the consumer
names exists."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlstream.common.config import ConsumerSettings, RlstreamConfig, load_config
from rlstream.common.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("override,key", [
    (["consumer.loss.eps_low=1.5"], "consumer.loss.eps_low"),
    (["consumer.loss.eps_low=1"], "consumer.loss.eps_low"),
    (["consumer.loss.name=ppo"], "consumer.loss.name"),
    (["consumer.loss.is_cap=0"], "consumer.loss.is_cap"),
    (["consumer.optimizer.grad_clip=-1"], "consumer.optimizer.grad_clip"),
    (["consumer.optimizer.betas=[0.9, 1.0]"], "consumer.optimizer.betas"),
    (["consumer.optimizer.name=lion"], "consumer.optimizer.name"),
    (["consumer.parallel.expert=0"], "consumer.parallel.expert"),
    (["consumer.memory.micro_batch_tokens=0"], "consumer.memory.micro_batch_tokens"),
    (["consumer.memory.logprob_chunk_tokens=-1"], "consumer.memory.logprob_chunk_tokens"),
    (["consumer.memory.attention=flash"], "consumer.memory.attention"),
    (["consumer.groups_per_batch=2", "consumer.group_size=2", "producer.group_size=2",
      "consumer.num_minibatches=5"], "consumer.num_minibatches"),
    (["consumer.lr=1e-4"], "consumer.lr"),  # the old flat keys are gone
    (["consumer.tensor_parallel_size=2"], "consumer.tensor_parallel_size"),
])
def test_bad_consumer_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, override, environ={})
    assert e.value.key == key and key in str(e.value)


def test_grad_clip_can_be_turned_off_and_defaults_are_the_config_files():
    cfg = load_config(None, ["consumer.optimizer.grad_clip=0"], environ={}).consumer
    assert cfg.optimizer.grad_clip == 0
    d = ConsumerSettings()
    assert (d.optimizer.lr, d.optimizer.grad_clip, d.loss.eps_low, d.loss.eps_high, d.loss.is_cap) ==\
        (1e-4, 1.0, 0.2, 0.27, 5.0)


@pytest.mark.parametrize("world,override,key", [
    ("2", ["consumer.parallel.expert=2", "consumer.parallel.tensor=2"], "consumer.parallel.expert"),
    ("4", ["consumer.parallel.tensor=3"], "consumer.parallel.tensor"),
    ("4", ["consumer.parallel.expert=3"], "consumer.parallel.expert"),
])
def test_the_layout_is_checked_against_the_launchers_world_size(world, override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, override, environ={"WORLD_SIZE": world})
    assert e.value.key == key
    load_config(None, override, environ={})  # no launcher: checked when the job starts


def test_fitting_layouts_load():
    for world, override in (("4", ["consumer.parallel.tensor=2", "consumer.parallel.expert=2"]),
                            ("8", ["consumer.parallel.expert=8"]), ("2", ["consumer.parallel.tensor=2"])):
        load_config(None, override, environ={"WORLD_SIZE": world})


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "rlstream.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_dry_run_refuses_a_bad_value_with_exit_2():
    proc = _cli("consumer", "--dry-run", "-c", "configs/tiny-cpu.yaml", "--set", "consumer.loss.eps_low=1.5")
    assert proc.returncode == 2, proc.stderr
    assert "consumer.loss.eps_low" in proc.stderr and proc.stdout == ""


def test_dry_run_prints_every_knob_the_trainer_reads():
    proc = _cli("consumer", "--dry-run", "-c", "configs/tiny-cpu.yaml", "--set", "consumer.optimizer.grad_clip=0")
    assert proc.returncode == 0, proc.stderr
    c = yaml.safe_load(proc.stdout)["consumer"]
    assert c["optimizer"] == {"name": "adamw", "lr": 0.0002, "weight_decay": 0.0, "betas": [0.9, 0.999],
                              "eps": 1e-8, "grad_clip": 0.0, "distributed": True, "cpu_offload_fraction": 0.0,
                              "cpu_offload_overlap": False}
    assert c["memory"] == {"micro_batch_tokens": 16384, "logprob_chunk_tokens": 2048,
                           "recompute": False, "attention": "auto", "experts": "auto",
                           "device_memory_gb": None, "host_memory_gb": None, "ranks_per_node": 8,
                           "expert_imbalance": 1.5}
    assert c["loss"] == {"name": "minirl", "eps_low": 0.2, "eps_high": 0.27, "is_cap": 5.0, "advantage": "auto",
                         "delta_low": None, "delta_high": None}
    assert c["stress"] == {"logprob_temperature_scale": 1.0}
    assert c["parallel"] == {"tensor": 1, "expert": 1, "world_size": None}


def _key_exists(dotted: str) -> bool:
    model = RlstreamConfig
    for part in dotted.split("."):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return False
        model = fields[part].annotation
    return True


def _error_keys(path: Path) -> list[tuple[int, str]]:
    """String keys passed to ConfigError / ParallelLayoutError (positional or key=), and
    every string literal that is a dotted `consumer.` key (tables of keys)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("ConfigError", "ParallelLayoutError"):
            out += [(node.lineno, a.value) for a in node.args[1:] + [k.value for k in node.keywords if k.arg == "key"]
                    if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("consumer.")\
                and all(part.isidentifier() for part in node.value.split(".")):
            out.append((node.lineno, node.value))
    return out


def test_every_config_error_of_the_consumer_names_an_existing_key():
    keys = [(f"{p.name}:{line}", k) for p in sorted((ROOT / "consumer").rglob("*.py")) for line, k in _error_keys(p)]
    assert len(keys) > 10, keys
    missing = [(where, k) for where, k in keys if not _key_exists(k)]
    assert not missing, f"ConfigError keys that are no setting: {missing}"
