"""Weight reload (producer/weights/reload.py): stage, verify, reload, roll back, with a
fake engine (pure logic; the real engine's reloads are in tests/integration)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlstream.common import metrics
from rlstream.common.control.messages import WeightsReady
from rlstream.common.errors import WeightReloadError
from rlstream.common.weights.store import WEIGHTS_FILE, sha256_file
from rlstream.producer.weights.reload import Reloader
from rlstream.producer.weights.trainer_link import GlooLink
from tests.support.fakes import FakeChannel


class FakeEngine:
    """Records loads; `fail` makes the next loads of those directories raise."""

    def __init__(self):
        self.version = 0
        self.loads: list[tuple[Path, int, bytes]] = []
        self.fail: set[str] = set()

    def reload_weights(self, weights_dir, version):
        d = Path(weights_dir)
        if d.name in self.fail:
            raise OSError(f"load of {d} failed halfway")
        self.loads.append((d, version, (d / WEIGHTS_FILE).read_bytes()))
        self.version = version
        return 0.0


def publish(root: Path, version: int, payload: bytes) -> WeightsReady:
    d = root / f"v{version}"
    d.mkdir(parents=True)
    (d / WEIGHTS_FILE).write_bytes(payload)
    return WeightsReady(version=version, transport="file", uri=d.as_uri(), sha256=sha256_file(d / WEIGHTS_FILE),
                        bytes=len(payload))


def failures() -> float:
    return metrics.value("rlstream_producer_weight_reload_failures_total")


@pytest.fixture
def setup(tmp_path):
    engine = FakeEngine()
    reloader = Reloader(engine, tmp_path / "base")
    yield engine, reloader, tmp_path / "store"
    reloader.close()
    assert not reloader.stage_root.exists()


def test_a_newer_verified_version_is_staged_and_served(setup):
    engine, reloader, store = setup
    assert reloader.apply(publish(store, 1, b"one"))
    assert engine.version == 1 and reloader.loaded == reloader.stage_root / "a"
    assert engine.loads[-1][2] == b"one" and metrics.value("rlstream_producer_policy_version") == 1
    assert reloader.apply(publish(store, 2, b"two"))  # the other slot: the served one stays intact
    assert reloader.loaded == reloader.stage_root / "b" and engine.loads[-1][2] == b"two"
    assert reloader.apply(publish(store, 3, b"three")) and reloader.loaded == reloader.stage_root / "a"


def test_the_staged_copy_survives_the_store_pruning_the_version(setup):
    engine, reloader, store = setup
    msg = publish(store, 1, b"one")
    reloader.apply(msg)
    (store / "v1" / WEIGHTS_FILE).unlink()  # the consumer's keep-K pruning
    assert (reloader.loaded / WEIGHTS_FILE).read_bytes() == b"one"


def test_old_and_equal_versions_are_ignored_without_counting(setup):
    engine, reloader, store = setup
    reloader.apply(publish(store, 2, b"two"))
    before, loads = failures(), len(engine.loads)
    assert not reloader.apply(publish(store, 1, b"one"))
    assert not reloader.apply(WeightsReady(version=2, transport="file", uri="file:///nowhere", sha256="0" * 64,
                                           bytes=1))
    assert failures() == before and len(engine.loads) == loads and engine.version == 2


@pytest.mark.parametrize("tamper", ["sha256", "bytes", "missing"])
def test_a_version_that_does_not_verify_is_refused_and_counted(setup, tamper, caplog):
    engine, reloader, store = setup
    msg = publish(store, 1, b"one")
    if tamper == "sha256":
        msg = msg.model_copy(update={"sha256": "f" * 64})
    elif tamper == "bytes":
        msg = msg.model_copy(update={"bytes": 99})
    else:
        msg = msg.model_copy(update={"uri": (store / "gone").as_uri()})
    before = failures()
    assert not reloader.apply(msg)
    assert failures() == before + 1 and engine.version == 0 and engine.loads == []
    assert reloader.loaded == store.parent / "base"
    assert "refusing weight version 1" in caplog.text and "still serving version 0" in caplog.text


def test_a_load_failing_halfway_restores_the_served_version(setup):
    engine, reloader, store = setup
    reloader.apply(publish(store, 1, b"one"))  # served from slot a
    engine.fail = {"b"}
    before = failures()
    assert not reloader.apply(publish(store, 2, b"two"))
    assert failures() == before + 1 and engine.version == 1
    assert engine.loads[-1] == (reloader.stage_root / "a", 1, b"one") and reloader.loaded == reloader.stage_root / "a"


def test_a_failed_rollback_raises_an_rlstream_error(setup):
    engine, reloader, store = setup
    reloader.apply(publish(store, 1, b"one"))
    engine.fail = {"a", "b"}
    with pytest.raises(WeightReloadError, match="inconsistent"):
        reloader.apply(publish(store, 2, b"two"))


# ---------------------------------------------------------------- the collective path

DIGEST_A, DIGEST_B = "a" * 64, "b" * 64


class FakeLink(GlooLink):
    """The real gloo link (GlooLink) over a fake command channel (tests/unit/producer/test_link.py): the test
    posts the trainer's commands (`send`); `on_connect` are posted into every new link."""

    made: list = []
    on_connect: list = []

    @classmethod
    def connect(cls, engine, endpoint, producer_id, timeout_s):
        link = cls(engine, endpoint, producer_id, timeout_s)
        link.channel, link.polls = FakeChannel(), 0
        for op, args in cls.on_connect:
            link.channel.post(op, **args)
        cls.made.append(link)
        return link

    def poll(self):
        self.polls += 1
        super().poll()


class FakeTransferEngine(FakeEngine):
    """A FakeEngine whose weight-transfer engine received (or failed) what `status` says."""

    weight_transfer = "rlstream_gloo"
    weight_workers = 1

    def __init__(self):
        super().__init__()
        self.status = {"state": "idle"}
        self.swaps: list[tuple[int, str]] = []
        self.discards = 0
        self.swap_error: Exception | None = None
        self.status_calls = 0

    def receive_weights(self):
        if self.status["state"] == "idle":  # a test may have set what arrives already
            self.status = {"state": "receiving"}

    def received(self, version, digest):
        self.status = {"state": "ready", "version": version, "digest": digest}

    def weight_status(self):
        self.status_calls += 1
        return dict(self.status)

    def swap_weights(self, version, digest):
        if self.swap_error is not None:
            raise self.swap_error
        self.swaps.append((version, digest))
        self.version, self.status = version, {"state": "idle"}
        return 0.01

    def discard_weights(self):
        self.discards += 1
        self.status = {"state": "idle"}


def collective(version, digest=DIGEST_A, endpoint="trainer:1", durable: WeightsReady | None = None,
               backend="rlstream_gloo") -> WeightsReady:
    extra = {} if durable is None else dict(durable_version=durable.version, durable_uri=durable.uri,
                                            durable_sha256=durable.sha256, durable_bytes=durable.bytes)
    return WeightsReady(version=version, transport="collective", digest=digest, endpoint=endpoint, backend=backend,
                        **extra)


def send(engine, version: int, received: str, sent: str | None = None, link: FakeLink | None = None) -> FakeLink:
    """The trainer starts `version` on the link, its bytes arrive with digest `received`, and it
    finishes it with the digest it sent (`sent`, default the same)."""
    link = link or FakeLink.made[-1]
    link.channel.post("start", version=version)
    link.channel.post("finish", version=version, digest=sent or received)
    engine.received(version, received)
    return link


def finish_ack(link: FakeLink) -> dict:
    return link.channel.acks[max(link.channel.acks)]


@pytest.fixture
def linked(tmp_path, monkeypatch):
    import rlstream.producer.weights.reload as reload_mod

    FakeLink.made, FakeLink.on_connect = [], []
    monkeypatch.setattr(reload_mod, "TrainerLink", FakeLink)
    engine = FakeTransferEngine()
    reloader = Reloader(engine, tmp_path / "base", "p0", timeout_s=30.0)
    yield engine, reloader, tmp_path / "store"
    reloader.close()


def taken(transport: str) -> float:
    return metrics.value("rlstream_producer_weight_versions_total", transport=transport)


def test_a_version_is_served_once_the_trainers_finish_carries_the_received_digest(linked):
    """The link is the version's one control channel: the announcement only names the endpoint
    (its digest is not what is checked), the trainer's finish carries the digest."""
    engine, reloader, _ = linked
    reloader.apply(collective(0))  # the trainer's start-up announcement: registers a link
    assert len(FakeLink.made) == 1 and FakeLink.made[0].endpoint == "trainer:1"
    link = FakeLink.made[0]
    link.channel.post("start", version=1)
    engine.received(1, DIGEST_B)  # the bytes arrived; the finish did not
    assert not reloader.tick() and engine.swaps == [] and engine.discards == 0
    before = taken("collective")
    link.channel.post("finish", version=1, digest=DIGEST_B)
    assert reloader.tick()
    assert engine.swaps == [(1, DIGEST_B)] and engine.version == 1 and reloader.loaded is None
    assert taken("collective") == before + 1 and metrics.value("rlstream_producer_policy_version") == 1
    assert finish_ack(link) == {"version": 1, "digest": DIGEST_B}  # answered once served
    assert reloader.state()["state"] == "serving"


def test_a_digest_other_than_the_sent_one_is_refused_counted_and_the_durable_copy_taken(linked):
    engine, reloader, store = linked
    durable = publish(store, 1, b"one")
    reloader.apply(collective(2, durable=durable))
    link = send(engine, 2, received=DIGEST_B, sent=DIGEST_A)  # corrupted in a way the group digests did not catch
    before, files = failures(), taken("file")
    assert reloader.tick()
    assert engine.swaps == [] and engine.discards == 1
    assert failures() == before + 1 and taken("file") == files + 1
    assert engine.version == 1 and engine.loads[-1][2] == b"one"  # the fallback: durable version 1
    assert "refused" in finish_ack(link)["error"] and not link.dead


def test_a_receive_that_failed_its_digest_check_is_refused_and_falls_back(linked, caplog):
    engine, reloader, store = linked
    reloader.apply(collective(3, durable=publish(store, 2, b"two")))
    link = FakeLink.made[0]
    link.channel.post("start", version=3)
    engine.status = {"state": "failed", "version": None, "error": "version 3, group 1: digest 12 != sent 34",
                     "digest_mismatch": True}
    before = failures()
    assert reloader.tick() and engine.version == 2 and failures() == before + 1
    assert "refusing weight version" in caplog.text and "group 1" in caplog.text
    assert not link.dead  # the stream was read to its end: the link stays


def test_a_broken_link_is_counted_and_registered_anew_without_a_refusal(linked, monkeypatch):
    import rlstream.producer.weights.reload as reload_mod

    engine, reloader, _ = linked
    monkeypatch.setattr(reload_mod, "_REJOIN_EVERY_S", 0.0)
    reloader.apply(collective(1))
    FakeLink.made[0].channel.post("start", version=1)
    engine.status = {"state": "failed", "error": "weight link receive failed: Connection reset by peer",
                     "digest_mismatch": False}
    refused, broken = failures(), metrics.value("rlstream_producer_weight_transfer_failures_total")
    assert not reloader.tick()
    assert FakeLink.made[0].dead and engine.discards == 1
    reloader.tick()  # the next tick drops it and registers again
    assert len(FakeLink.made) == 2 and reloader.link is FakeLink.made[1]
    assert metrics.value("rlstream_producer_weight_transfer_failures_total") == broken + 1 and failures() == refused


def test_a_version_the_link_does_not_deliver_in_time_comes_from_the_durable_store(linked):
    engine, reloader, store = linked
    reloader.timeout_s = 0.05
    reloader.apply(collective(4, durable=publish(store, 3, b"three")))
    assert engine.version == 0
    time.sleep(0.1)
    assert reloader.tick() and engine.version == 3 and engine.loads[-1][2] == b"three"
    send(engine, 4, DIGEST_A)  # it arrives after all: served next
    assert reloader.tick() and engine.version == 4


def test_a_new_endpoint_replaces_the_link_and_a_version_already_served_is_acknowledged(linked):
    engine, reloader, _ = linked
    reloader.apply(collective(1))
    send(engine, 1, DIGEST_A)
    assert reloader.tick() and engine.version == 1
    reloader.apply(collective(1, endpoint="trainer:2"))  # the trainer restarted at version 1
    assert [lk.endpoint for lk in FakeLink.made] == ["trainer:1", "trainer:2"]
    link = send(engine, 1, DIGEST_A)  # it sends its current version to the new link: nothing new
    assert not reloader.tick() and engine.discards == 1 and engine.swaps == [(1, DIGEST_A)]
    assert finish_ack(link) == {"version": 1, "digest": DIGEST_A}  # held: the trainer counts it delivered


def test_catch_up_serves_the_announced_version_before_generating(linked):
    engine, reloader, store = linked
    FakeLink.on_connect = [("start", {"version": 2}), ("finish", {"version": 2, "digest": DIGEST_A})]
    engine.received(2, DIGEST_A)
    assert reloader.catch_up(collective(2)) and engine.version == 2
    # no link delivery: the durable copy, after the timeout
    FakeLink.on_connect = []
    reloader.timeout_s = 0.05
    assert reloader.catch_up(collective(4, DIGEST_B, durable=publish(store, 4, b"four"))) and engine.version == 4
    assert reloader.catch_up(publish(store, 5, b"five")) and engine.version == 5  # transport file


def test_a_swap_failing_halfway_restores_the_newest_durable_copy(linked):
    engine, reloader, store = linked
    reloader.apply(collective(1, durable=publish(store, 1, b"one")))
    send(engine, 1, DIGEST_A)
    assert reloader.tick() and reloader.loaded is None  # served from the link
    reloader.apply(collective(2, DIGEST_B, durable=publish(store, 2, b"two")))
    link = send(engine, 2, DIGEST_B)
    engine.swap_error = RuntimeError("layer 3 failed to load")
    before = failures()
    assert not reloader.tick()
    assert failures() == before + 1 and engine.version == 2 and engine.loads[-1][2] == b"two"
    assert reloader.loaded is not None and "layer 3" in finish_ack(link)["error"]


def test_a_file_announcement_keeps_the_link(linked):
    """A version announced as a file (no endpoint) between collective ones leaves the link up:
    it is not re-registered at the next collective version."""
    engine, reloader, store_dir = linked
    reloader.apply(collective(0))
    link = FakeLink.made[-1]
    assert reloader.apply(publish(store_dir, 1, b"v1"))
    reloader.tick()
    reloader.apply(collective(2, DIGEST_B))
    assert len(FakeLink.made) == 1 and reloader.link is link


def test_the_engine_status_is_asked_only_while_a_background_receive_is_pending(linked):
    """`weight_status` is a collective_rpc to every worker: not once per loop on nccl
    (it loads inside the trainer's update command), and on rlstream_gloo only from the
    receive's start until its version is all here."""
    engine, reloader, _ = linked
    engine.weight_transfer = "nccl"
    reloader.apply(collective(1, backend="nccl"))
    for _ in range(5):
        reloader.tick()
    assert engine.status_calls == 0 and len(FakeLink.made) == 1
    engine.weight_transfer = "rlstream_gloo"
    reloader.apply(collective(1))
    for _ in range(5):
        reloader.tick()
    assert engine.status_calls == 0  # idle: nothing started
    FakeLink.made[0].channel.post("start", version=1)
    reloader.tick()
    reloader.tick()
    assert engine.status_calls == 2
    FakeLink.made[0].channel.post("finish", version=1, digest=DIGEST_A)
    engine.received(1, DIGEST_A)
    assert reloader.tick() and engine.version == 1 and engine.status_calls == 3
    for _ in range(5):
        reloader.tick()
    assert engine.status_calls == 3  # served: settled until the next start


def test_a_trainer_on_another_backend_is_not_linked_and_durable_copies_are_served(linked, caplog):
    """The backend is named once, by the trainer, in the announcement: a producer whose engine
    receives with another one says so and takes the durable copies, instead of re-registering a
    link that fails at its first init every few seconds."""
    engine, reloader, store = linked
    before = metrics.value("rlstream_producer_weight_transfer_failures_total")
    msg = collective(3, DIGEST_A, durable=publish(store, 3, b"three")).model_copy(update={"backend": "nccl"})
    assert reloader.catch_up(msg, timeout_s=5.0) and engine.version == 3 and engine.loads[-1][2] == b"three"
    assert FakeLink.made == [] and not reloader.tick()
    assert reloader.state()["backend_mismatch"] == "trainer sends nccl, engine receives rlstream_gloo"
    assert metrics.value("rlstream_producer_weight_transfer_failures_total") == before + 1  # once, not per tick
    assert "receives with rlstream_gloo" in caplog.text
    reloader.apply(collective(4, DIGEST_B).model_copy(update={"backend": "rlstream_gloo"}))  # the same: linked
    assert len(FakeLink.made) == 1
    assert reloader.state()["backend_mismatch"] is None  # /healthz tells the newest announcement's story


# ---------------------------------------------------------------- durable copies come from the store only


@pytest.fixture
def confined(tmp_path):
    from rlstream.common.weights.store import WeightStore

    engine, store = FakeEngine(), WeightStore(tmp_path / "weights")
    reloader = Reloader(engine, tmp_path / "base", "p/0", store_dir=store.root)
    yield engine, reloader, store, tmp_path
    reloader.close()


def written(store, version: int, payload: bytes) -> WeightsReady:
    """A version as the trainer writes it: its directory and manifest in the store."""
    import torch

    src = store.root.parent / f"src{version}"  # the base model dir (config files: none here)
    src.mkdir(parents=True, exist_ok=True)
    m = store.write(version, {"w": torch.frombuffer(bytearray(payload), dtype=torch.uint8)}, src)
    return WeightsReady(version=version, transport="file", uri=m["uri"], sha256=m["sha256"], bytes=m["bytes"])


def test_a_durable_copy_named_outside_the_weight_store_is_refused(confined):
    """An announcement is a Kafka message: one naming a directory of its own (with a digest that
    matches its bytes) must not be loaded."""
    engine, reloader, store, tmp = confined
    before = failures()
    forged = publish(tmp / "elsewhere", 7, b"forged")
    assert not reloader.apply(forged)
    assert engine.version == 0 and engine.loads == [] and failures() == before + 1
    assert "not a version directory of the weight store" in reloader.state()["failure"]["reason"]


def test_a_durable_copy_whose_manifest_names_other_bytes_is_refused(confined):
    engine, reloader, store, _ = confined
    good = written(store, 3, b"three")
    forged = good.model_copy(update={"version": 1_000_000})  # the trainer's bytes under another version
    assert not reloader.apply(forged) and engine.version == 0
    assert "manifest names version 3" in reloader.state()["failure"]["reason"]
    assert reloader.apply(good) and engine.version == 3  # what the trainer wrote is taken


def test_durable_copies_are_staged_beside_the_store_as_links(confined):
    """Staging on the store's file system: hard links, no copy of the model on the container's disk."""
    import os

    engine, reloader, store, _ = confined
    msg = written(store, 2, b"two")
    assert reloader.apply(msg)
    staged, src = reloader.loaded / WEIGHTS_FILE, store.root / "v00000002" / WEIGHTS_FILE
    assert reloader.loaded.parent.parent == store.root / ".staging" and src.exists()
    assert os.stat(staged).st_ino == os.stat(src).st_ino
    assert store.versions() == [2]  # the staging area is not a version
