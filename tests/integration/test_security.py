"""Issue #8.6 (security), the parts that need no running service.

- Nothing from Kafka, the weight store or a checkpoint is unpickled or
  evaluated: a source scan of producer/, consumer/ and common/ finds no
  pickle/marshal/eval/exec/unsafe yaml/torch.load without weights_only; a
  checkpoint whose trainer.pt carries a pickle payload is refused by the real
  CheckpointManager without running it.
- Kafka SASL_SSL settings in a config file reach the Kafka client: every
  client is built by the driver layer (common/kafka/client.py), through
  `load_config` -> `make_consumer`/`make_producer` into kafka-python's own
  config, and on the wire (the client opens with a TLS ClientHello on a
  loopback listener).

The admin API (missing/wrong tokens, out-of-range values) and hostile
control/policy messages are tested against a live consumer in
test_fuzz_training.py; pickles on the rollouts topic there too.
"""
from __future__ import annotations

import ast
import os
import pickle
import socket
import ssl
import threading
from pathlib import Path

import pytest

from tests.support.fakes import PickleBomb

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("producer", "consumer", "common")
MARKER = Path(f"/tmp/rlstream-pwned-ckpt-{os.getpid()}")


def _sources():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            yield node, owner, name


# torch.distributed's *_object collectives pickle. None is allowed: the rank protocol sends commands
# and batch shares as plain tensors (consumer/ranks/channel.py, consumer/ranks/shares.py) and the weight export
# gathers raw bytes (consumer/train/export.py).
ALLOWED: set[tuple[str, str]] = set()


# The record decoder's object_pairs_hook builds a plain dict and refuses repeated keys; nothing else.
ALLOWED_MSGPACK_HOOKS = {("common/record/codec.py", "object_pairs_hook", "_unique_map")}


def _allowed_msgpack_hook(rel: str, kw: dict) -> bool:
    return all(isinstance(v, ast.Name) and (rel, k, v.id) in ALLOWED_MSGPACK_HOOKS
               for k, v in kw.items() if k in ("ext_hook", "object_hook", "object_pairs_hook"))


def test_no_unpickling_or_evaluation_in_the_services():
    bad = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), rel)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for m in mods:
                    if m.split(".")[0] in ("pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle", "joblib"):
                        bad.append(f"{rel}:{node.lineno} imports {m}")
        for node, owner, name in _calls(tree):
            kw = {k.arg: k.value for k in node.keywords}
            where = f"{rel}:{node.lineno}"
            if name in ("eval", "exec") and owner == "":
                bad.append(f"{where} calls {name}()")
            elif name == "load" and owner == "torch":
                wo = kw.get("weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    bad.append(f"{where} torch.load without weights_only=True")
            elif name in ("load", "load_all") and owner == "yaml":
                bad.append(f"{where} yaml.{name} (use safe_load)")
            elif name == "load" and owner in ("np", "numpy"):
                ap = kw.get("allow_pickle")
                if isinstance(ap, ast.Constant) and ap.value is True:
                    bad.append(f"{where} numpy.load(allow_pickle=True)")
            elif name in ("unpackb", "Unpacker", "unpack") and owner == "msgpack":
                hooks = {"ext_hook", "object_hook", "object_pairs_hook"} & set(kw)
                if hooks and not _allowed_msgpack_hook(rel, kw):
                    bad.append(f"{where} msgpack with a custom hook")
            elif name in ("broadcast_object_list", "all_gather_object", "scatter_object_list",
                          "gather_object", "recv_object_list"):
                if (rel, name) not in ALLOWED:
                    bad.append(f"{where} {name} (pickles)")
    assert not bad, "\n".join(bad)


KAFKA_CLIENTS = ("KafkaProducer", "KafkaConsumer", "KafkaAdminClient")
DRIVER_LAYER = "common/kafka/client.py"


def test_every_kafka_client_is_built_by_the_driver_layer():
    """SASL/SSL settings can only be dropped by a client built outside common/kafka/client.py: no other
    module of the services imports or calls a kafka-python client class. Inside it, every client is
    built from `client_kwargs` (tests/unit/common/kafka/test_kafka_client.py checks each one's kwargs)."""
    bad = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), rel)
        if rel == DRIVER_LAYER:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kafka":
                bad += [f"{rel}:{node.lineno} imports {a.name}" for a in node.names if a.name in KAFKA_CLIENTS]
        for node, _, name in _calls(tree):
            if name in KAFKA_CLIENTS:
                bad.append(f"{rel}:{node.lineno} {name}(...) outside {DRIVER_LAYER}")
    assert not bad, "\n".join(bad)
    driver = ast.parse((ROOT / DRIVER_LAYER).read_text())
    built = {n.id for n in ast.walk(driver) if isinstance(n, ast.Name) and n.id in KAFKA_CLIENTS}
    assert built == set(KAFKA_CLIENTS), built


def test_a_pickled_checkpoint_is_refused_without_running_it(tmp_path):
    import json

    import torch

    from rlstream.consumer.checkpoint.files import STATE, TRAINER, CheckpointManager

    MARKER.unlink(missing_ok=True)
    d = tmp_path / "step-00000001"
    d.mkdir()
    torch.save({"model": PickleBomb(MARKER)}, d / TRAINER)
    (d / STATE).write_text(json.dumps({"step": 1, "version": 1, "offsets": {"0": 0}, "processed": [],
                                       "counters": {}}))
    mgr = CheckpointManager(tmp_path)
    st, path = mgr.latest()
    with pytest.raises(pickle.UnpicklingError):
        mgr.load_trainer_state(path)
    assert not MARKER.exists(), "loading a checkpoint ran code from it"


# ---------------------------------------------------------------- SASL_SSL reaches the client

def _cafile() -> str:
    paths = ssl.get_default_verify_paths()
    for p in (paths.cafile, paths.openssl_cafile):
        if p and Path(p).is_file():
            return p
    import certifi

    return certifi.where()


def _sasl_ssl_config(tmp_path, port: int):
    from rlstream.common.config import load_config

    cfg = tmp_path / "sasl.yaml"
    cfg.write_text(f"""
kafka:
  bootstrap_servers: 127.0.0.1:{port}
  security_protocol: SASL_SSL
  sasl_mechanism: SCRAM-SHA-512
  sasl_plain_username: rl-user
  sasl_plain_password: s3cret-from-config
  ssl_cafile: {_cafile()}
  ssl_check_hostname: true
  request_timeout_ms: 1500
""")
    return load_config(cfg, environ={})


def test_sasl_ssl_settings_reach_the_kafka_client_config(tmp_path):
    from rlstream.common.kafka.client import client_kwargs, make_consumer, make_producer

    cfg = _sasl_ssl_config(tmp_path, 9)
    kw = client_kwargs(cfg.kafka)
    assert kw["security_protocol"] == "SASL_SSL" and kw["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kw["sasl_plain_username"] == "rl-user" and kw["sasl_plain_password"] == "s3cret-from-config"
    assert kw["ssl_cafile"] == _cafile() and kw["ssl_check_hostname"] is True
    c = make_consumer(cfg.kafka, api_version=(2, 8))  # no bootstrap I/O
    p = make_producer(cfg.kafka, "dlq", api_version=(2, 8))
    try:
        for client in (c, p):
            for k in ("security_protocol", "sasl_mechanism", "sasl_plain_username", "sasl_plain_password",
                      "ssl_cafile", "ssl_check_hostname"):
                assert client.config[k] == kw[k], (type(client).__name__, k)
    finally:
        c.close()
        p.close(timeout=0)
    from rlstream.common.config import dump_config

    assert "s3cret-from-config" not in dump_config(cfg), "--dry-run prints the SASL password"


def test_sasl_ssl_client_speaks_tls_on_the_wire(tmp_path):
    """A listener that records the first bytes: the client opens with a TLS handshake record."""
    from rlstream.common.kafka.client import make_producer

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(20)
    first: list[bytes] = []

    def accept():
        try:
            conn, _ = srv.accept()
            conn.settimeout(10)
            first.append(conn.recv(5))
            conn.close()
        except OSError:
            pass
    t = threading.Thread(target=accept, daemon=True)
    t.start()
    cfg = _sasl_ssl_config(tmp_path, srv.getsockname()[1])
    p = make_producer(cfg.kafka, "rollouts", api_version=(2, 8), max_block_ms=3000)
    try:
        with pytest.raises(Exception):  # no TLS server there: metadata never arrives
            p.partitions_for("rlstream.rollouts")
    finally:
        p.close(timeout=0)
    t.join(20)
    srv.close()
    assert first and first[0][:1] == b"\x16" and first[0][1:2] == b"\x03", first  # TLS handshake, version 3.x
