"""The consumer service against the real broker, real Megatron-core, tiny model.

A synthetic producer publishes valid records with known policy versions:
- stale groups are dropped at the configured bound and kept below it;
- in reweight mode the sample weights follow decay ** staleness;
- a control change on the topic takes effect at the next batch boundary (the
  service applies it itself: no test calls apply_control), also when it
  arrives while the consumer sits idle waiting for data;
- an announced version (collective: the snapshot the links stream, and its
  durable copy) is an HF directory that transformers opens and whose log-probs
  equal the trainer's, and that the vLLM engine reloads;
- a consumer killed with SIGKILL between checkpoints resumes from the last one,
  redoes the steps after it, never trains a rollout_id twice in the final
  model's lineage and never reuses a version; every record is accounted for;
- under torchrun each rank trains on its own share; tp2 restarts from its shards.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from rlstream.common.config import RlstreamConfig
from rlstream.common.control.messages import encode_control
from rlstream.common.control.plane import ControlPlaneWriter
from rlstream.common.control.signing import publish, signing_key
from tests.fixtures.kafka import make_kafka_settings
from tests.support.configs import ADMIN_TOKEN
from tests.support.synthetic import publish_groups, synthetic_group

pytestmark = [pytest.mark.broker, pytest.mark.megatron]

G, B = 4, 2


def consumer_config(kafka, tiny_model_dir, tmp: Path, **consumer) -> RlstreamConfig:
    c = {"group_size": G, "groups_per_batch": B, "optimizer": {"lr": 1e-3}, "checkpoint_dir": str(tmp / "ckpt"),
         "weight_store_dir": str(tmp / "weights"), "group_timeout_s": 30.0,
         "http": {"admin_token": ADMIN_TOKEN}, **consumer}
    return RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"path": str(tiny_model_dir), "build_tiny": False},
        "staleness": {"max_staleness": 1, "mode": "drop"},
        "producer": {"group_size": G}, "consumer": c})


@pytest.fixture(scope="module")
def service(broker, tiny_model_dir, tmp_path_factory):
    """One in-process ConsumerService for the module (Megatron state is per process)."""
    from rlstream.common.kafka.publisher import RolloutPublisher
    from rlstream.consumer.service import ConsumerService

    tmp = tmp_path_factory.mktemp("consumer")
    kafka = make_kafka_settings(broker.bootstrap, tmp / "blobs", rollouts_partitions=2)
    svc = ConsumerService(consumer_config(kafka, tiny_model_dir, tmp), broker.bootstrap)
    svc.start()
    pub = RolloutPublisher(kafka)
    yield svc, pub, kafka
    pub.close()
    svc.close()


def step(svc):
    batch = svc.next_batch()
    out = svc.train_step(batch)
    svc.checkpoint()
    svc.publish_weights()
    return batch, out


@pytest.mark.timeout(300)
def test_gate_drops_at_bound_and_keeps_below(service):
    svc, pub, _ = service
    rng = np.random.default_rng(0)
    v0 = svc.version
    # two on-policy steps: the trainer reaches version v0 + 2
    for s in range(2):
        publish_groups(pub, [synthetic_group(f"on{s}-{i}", G, v0 + s, rng) for i in range(B)])
        batch, out = step(svc)
        assert [rg.staleness for rg in batch] == [0, 0]
        assert np.isfinite(out["loss"])
    assert svc.version == v0 + 2
    dropped_before = svc.ledger.counters["dropped_stale"]
    # staleness 2 (> max 1) is dropped; 1 and 0 are kept
    publish_groups(pub, [synthetic_group("stale2", G, v0, rng), synthetic_group("stale1", G, v0 + 1, rng),
                         synthetic_group("fresh", G, v0 + 2, rng)])
    batch = svc.next_batch()
    assert sorted(rg.group.group_id for rg in batch) == ["fresh", "stale1"]
    assert sorted(rg.staleness for rg in batch) == [0, 1]
    assert svc.ledger.counters["dropped_stale"] - dropped_before == G
    svc.train_step(batch)
    svc.checkpoint()
    svc.publish_weights()


@pytest.mark.timeout(300)
def test_reweight_mode_via_control_topic(service):
    from kafka import KafkaProducer

    from rlstream.common.kafka.client import client_kwargs

    svc, pub, kafka = service
    p = KafkaProducer(**client_kwargs(kafka), acks="all")
    for key, value in (("mode", "reweight"), ("decay", 0.5), ("max_staleness", 3)):
        k, v = encode_control(key, value, by="test")
        publish(p, kafka.topics.control, k, v, signing_key(ADMIN_TOKEN)).get(timeout=10)
    p.close()
    V = svc.version
    rng = np.random.default_rng(1)
    publish_groups(pub, [synthetic_group("rw3", G, V - 3, rng), synthetic_group("rw1", G, V - 1, rng)])
    batch = svc.next_batch()  # its boundary applies the three changes acknowledged above
    assert (svc.control.mode, svc.control.decay, svc.control.max_staleness) == ("reweight", 0.5, 3)
    weights = {rg.group.group_id: rg.weights for rg in batch}
    assert weights == {"rw3": (0.5 ** 3,) * G, "rw1": (0.5,) * G}
    svc.train_step(batch)
    svc.checkpoint()
    svc.publish_weights()


@pytest.mark.timeout(300)
def test_progress_announcement_counts_held_records(service):
    """While the trainer holds one complete group and waits for a second, its
    progress announcement says: everything read (read_offsets = topic ends),
    G records held. The checkpointed offsets stay pinned at the held group;
    producers that counted from them saw a long queue and stopped admitting,
    which stalled the 10-minute soak (tests/unit/test_admission.py)."""
    import threading

    svc, pub, _ = service
    V = svc.version
    rng = np.random.default_rng(7)
    publish_groups(pub, [synthetic_group("held", G, V, rng)])
    result = {}
    waiter = threading.Thread(target=lambda: result.update(batch=svc.next_batch()), daemon=True)
    waiter.start()
    deadline = time.time() + 30
    while True:
        ann = svc.announcer.sent
        ends = svc.reader.end_offsets()
        if ann.held_records == G and ann.read_offsets == ends:
            break
        assert time.time() < deadline, f"no progress announcement with the held group: {ann}"
        time.sleep(0.2)
    checkpointed = svc.ledger.safe_offsets(svc.reader.positions())
    pinned = sum(ends[p] - checkpointed.get(p, 0) for p in ends)
    assert pinned >= G, "the held group should pin the checkpointed offsets"
    publish_groups(pub, [synthetic_group("second", G, V, rng)])
    waiter.join(timeout=60)
    assert sorted(rg.group.group_id for rg in result["batch"]) == ["held", "second"]
    svc.train_step(result["batch"])
    svc.checkpoint()
    svc.publish_weights()
    assert svc.announcer.sent.held_records == 0


@pytest.mark.timeout(300)
def test_announced_version_opens_in_transformers_with_same_logprobs(service):
    import torch
    from transformers import AutoModelForCausalLM

    from rlstream.common.control.messages import WeightsReady
    from rlstream.common.weights.store import verify
    from rlstream.consumer.train.model import per_token_logprobs

    svc, _, kafka = service
    deadline = time.time() + 10
    while svc.follower.view.weights is None or svc.follower.view.weights.version < svc.version:
        svc.follower.catch_up()
        assert time.time() < deadline, "announcement not seen on the policy topic"
    ann: WeightsReady = svc.follower.view.weights
    # the collective path (the default) announces the snapshot every producer link streams...
    snap = svc.announcer.snapshot
    assert (ann.transport, ann.version, ann.digest, ann.endpoint, ann.backend) ==\
        ("collective", svc.version, snap.digest, svc.announcer.sender.endpoint, "rlstream_gloo")
    # ...and its durable copy, written in the background every K versions and at shutdown (here: now)
    svc.announcer.durable.flush(snap)
    copy = svc.announcer.durable.newest
    assert copy.version == svc.version
    d = verify(copy.uri, copy.sha256, copy.bytes)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tokens = torch.tensor([[4, 13, 5, 17, 20, 6, 7, 1]])
    with torch.no_grad():
        logits = hf(tokens).logits[:, :-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
        svc.leader.trainer.model.eval()
        ours = per_token_logprobs(svc.leader.trainer.model, tokens)
        if isinstance(ours, tuple):
            ours = ours[0]
    assert torch.allclose(ours[:, : ref.shape[1]].float(), ref, atol=1e-4), (ours - ref).abs().max()


@pytest.mark.timeout(300)
def test_read_ahead_groups_are_gated_at_the_optimizer_step(service):
    """Groups read ahead of their batch are judged at the version they train at."""
    svc, pub, kafka = service
    writer = ControlPlaneWriter(kafka, signing_key(ADMIN_TOKEN))
    writer.set_control("mode", "drop", by="test")
    writer.set_control("max_staleness", 0, by="test")
    writer.close()
    V = svc.version
    publish_groups(pub, [synthetic_group(f"ahead{i}", G, V, np.random.default_rng(10 + i)) for i in range(2 * B)])
    dropped = svc.ledger.counters["dropped_stale"]
    batch = svc.next_batch()
    assert (svc.control.max_staleness, svc.control.mode) == (0, "drop")  # applied at this batch's boundary
    assert [rg.staleness for rg in batch] == [0] * B
    assert len(svc.ledger.complete) == B  # read ahead, not yet gated
    svc.train_step(batch)  # the trainer moves to V + 1: the waiting groups are now 1 version stale
    svc.checkpoint()
    publish_groups(pub, [synthetic_group(f"next{i}", G, V + 1, np.random.default_rng(20 + i)) for i in range(B)])
    batch = svc.next_batch()
    assert sorted(rg.group.group_id for rg in batch) == [f"next{i}" for i in range(B)]
    assert svc.ledger.counters["dropped_stale"] - dropped == B * G
    svc.train_step(batch)
    svc.checkpoint()
    svc.publish_weights()


@pytest.mark.timeout(300)
def test_a_change_on_an_idle_consumer_applies_to_its_next_batch(service):
    """The consumer waits for data (inside next_batch, nothing read yet) when max_staleness drops
    from 1 to 0; the batch it then builds is gated with 0: a group one version old is dropped.
    (It took two batch boundaries before: the follower's first poll after a change often returns
    nothing, and an idle consumer polled only at the top of its loop.)"""
    import threading

    svc, pub, kafka = service
    writer = ControlPlaneWriter(kafka, signing_key(ADMIN_TOKEN))
    writer.set_control("mode", "drop", by="test")
    writer.set_control("max_staleness", 1, by="test")
    V = svc.version
    rng = np.random.default_rng(30)
    publish_groups(pub, [synthetic_group(f"warm{i}", G, V, rng) for i in range(B)])
    step(svc)  # a batch under max_staleness 1
    assert svc.control.max_staleness == 1
    result = {}
    waiter = threading.Thread(target=lambda: result.update(batch=svc.next_batch()), daemon=True)
    waiter.start()
    time.sleep(1.0)  # idle: the reader finds nothing
    assert waiter.is_alive() and not svc.ledger.complete
    writer.set_control("max_staleness", 0, by="test")
    writer.close()
    dropped = svc.ledger.counters["dropped_stale"]
    # one group one version old (kept under 1, dropped under 0), then B fresh ones
    publish_groups(pub, [synthetic_group("one_old", G, V, rng)])
    publish_groups(pub, [synthetic_group(f"fresh{i}", G, V + 1, rng) for i in range(B)])
    waiter.join(timeout=60)
    assert sorted(rg.group.group_id for rg in result["batch"]) == [f"fresh{i}" for i in range(B)]
    assert svc.ledger.counters["dropped_stale"] - dropped == G and svc.control.max_staleness == 0
    svc.train_step(result["batch"])
    svc.checkpoint()
    svc.publish_weights()

def test_dynamic_sampling_filters_equal_reward_groups_and_fills_the_batch(service):
    """Complete groups whose G rewards are all equal are filtered at the gate
    (outcome `filtered`, not trained), the batch is filled with the next groups
    from the stream, and the progress announcement carries the filtered share."""
    import dataclasses

    from rlstream.common import metrics

    svc, pub, _ = service
    assert svc.ccfg.dynamic_sampling == "auto" and svc.ccfg.filters_zero_variance  # minirl, G = 4
    V = svc.version
    rng = np.random.default_rng(30)
    same = [[dataclasses.replace(r, reward=0.0) for r in synthetic_group(f"same{i}", G, V, rng)] for i in range(B)]
    publish_groups(pub, same)
    deadline = time.time() + 30
    while len(svc.ledger.complete) < B:  # read, complete, not gated yet: first in line
        svc._read(0.2)
        assert time.time() < deadline, "the equal-reward groups were not read"
    publish_groups(pub, [synthetic_group(f"mixed{i}", G, V, rng) for i in range(B)])
    filtered = svc.ledger.counters["filtered"]
    exposed = metrics.value("rlstream_consumer_records_total", outcome="filtered")
    batch = svc.next_batch()
    assert sorted(rg.group.group_id for rg in batch) == [f"mixed{i}" for i in range(B)]
    assert svc.ledger.counters["filtered"] - filtered == B * G
    assert metrics.value("rlstream_consumer_records_total", outcome="filtered") - exposed == B * G
    trained = svc.ledger.counters["trained"]
    svc.train_step(batch)
    assert svc.ledger.counters["trained"] - trained == B * G
    svc.checkpoint()
    svc.publish_weights()
    assert 0 < svc.announcer.sent.filtered_share == round(svc.filtered.value, 3)


# --------------------------------------------------------- crash and resume

def _write_config(path: Path, cfg: RlstreamConfig) -> Path:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def _committed_steps(ckpt_dir: Path) -> dict[int, list[str]]:
    """step -> trained rollout ids in the lineage of the final checkpoint."""
    from tests.support.audit import lineage_steps

    return lineage_steps(ckpt_dir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_between_checkpoints_resumes_exactly_once(broker, tiny_model_dir, tmp_path):
    """Checkpoints every 2 steps; SIGKILL after step 3 (checkpointed: step 2). The
    restart resumes from step 2, redoes step 3 with re-read records, finishes at 6:
    in the final model's lineage every record is trained once, and the version
    the dead step 3 announced is never reused."""
    from rlstream.common.kafka.publisher import RolloutPublisher
    from rlstream.consumer.checkpoint.files import CheckpointManager
    from rlstream.harness.supervisor import Service, wait_until
    from tests.support.audit import audit_steps
    from tests.support.topics import announced_versions, weights_announcements

    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs", rollouts_partitions=2)
    total_steps = 6
    cfg = consumer_config(kafka, tiny_model_dir, tmp_path, max_steps=total_steps, checkpoint={"every_steps": 2})
    cfg_path = _write_config(tmp_path / "consumer.yaml", cfg)
    rng = np.random.default_rng(2)
    pub = RolloutPublisher(kafka)
    groups = [synthetic_group(f"k{i}", G, 0, rng) for i in range(B * total_steps)]
    published = publish_groups(pub, groups[:3 * B])  # three steps' worth, then it waits for data

    ckpt_dir = tmp_path / "ckpt"
    ckpts = CheckpointManager(ckpt_dir)
    consumer = Service("consumer", cfg_path, tmp_path / "logs", sets=["staleness.max_staleness=100"])
    with consumer.start():
        wait_until(lambda: max(audit_steps(ckpt_dir), default=0) >= 3 and ckpts.latest() is not None, 240,
                   "three steps and a checkpoint", [consumer])
        time.sleep(1.0)  # waiting for data now: nothing else to train
        consumer.kill(timeout_s=30)
    killed = ckpts.latest()[0]
    assert (killed.step, max(audit_steps(ckpt_dir))) == (2, 3), "the kill must land between checkpoints"
    assert max(a.version for a in weights_announcements(kafka)) == 3
    published += publish_groups(pub, groups[3 * B:])
    pub.close()
    with consumer.start():
        assert consumer.wait(timeout_s=400) == 0, consumer.log_tail(3000)
    assert "resumed from step-00000002" in consumer.log_text()
    steps = _committed_steps(ckpt_dir)
    assert sorted(steps) == list(range(1, total_steps + 1))
    trained = [rid for ids in steps.values() for rid in ids]
    assert len(trained) == len(set(trained)), "a rollout_id was trained twice"
    assert set(trained) == set(published)
    final = ckpts.latest()[0]
    assert final.step == total_steps
    assert final.counters["trained"] == len(published)
    assert sum(final.counters.values()) == len(published)
    versions = announced_versions(weights_announcements(kafka))  # a version is never given to other weights
    assert versions == sorted(versions), f"a version was reused: {versions}"
    # the restored step-2 weights came back as version 4, above the dead 3; steps 3..6 -> 5..8
    assert versions[-5:] == [4, 5, 6, 7, 8] and final.version == 8


def _torchrun_consumer(cfg_path: Path) -> str:
    """Two ranks under torchrun until they exit (waited on while they make progress: a loaded
    machine is slow, not stuck); their output."""
    from tests.support.progress import run_to_exit

    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rc, out = run_to_exit([str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "rlstream", "consumer",
                           "-c", str(cfg_path)], env)
    assert rc == 0, out[-4000:]
    assert "rank 1 stopping with rank 0" in out
    return out


# layout -> consumer settings; world size 2 (dp = 2 / tp)
TWO_RANK_LAYOUTS = {"dp2": {}, "tp2": {"parallel": {"tensor": 2}},
                    "dp2_ep2": {"parallel": {"expert": 2}}}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(TWO_RANK_LAYOUTS))
def test_two_ranks_under_torchrun(broker, tiny_model_dir, tmp_path, layout):
    """torchrun --nproc_per_node 2: rank 0 reads and broadcasts, both ranks train,
    exit 0. Under tensor/expert parallelism each rank writes its own checkpoint
    shard; tp2 and dp2_ep2 (whose dense optimizer state is spread over both ranks,
    one file each) then restart from those files and train one more step."""
    from rlstream.common.kafka.publisher import RolloutPublisher

    kafka = make_kafka_settings(broker.bootstrap, tmp_path / "blobs", rollouts_partitions=2)
    cfg = consumer_config(kafka, tiny_model_dir, tmp_path, max_steps=2, **TWO_RANK_LAYOUTS[layout])
    cfg_path = _write_config(tmp_path / "consumer.yaml", cfg)
    pub = RolloutPublisher(kafka)
    try:
        _two_rank_run(kafka, pub, tiny_model_dir, tmp_path, layout, cfg_path)
    finally:
        pub.close()


def _two_rank_run(kafka, pub, tiny_model_dir, tmp_path, layout, cfg_path):
    import torch

    from rlstream.consumer.checkpoint.files import CheckpointManager

    published = publish_groups(pub, [synthetic_group(f"mr{i}", G, 0, np.random.default_rng(i))
                                     for i in range(2 * B)])
    _torchrun_consumer(cfg_path)
    steps = _committed_steps(tmp_path / "ckpt")
    assert sorted(steps) == [1, 2]
    assert sorted(rid for ids in steps.values() for rid in ids) == sorted(published)

    st, path = CheckpointManager(tmp_path / "ckpt").latest()
    shards = sorted(p.name for p in path.glob("trainer*.pt"))
    if layout == "dp2":
        assert shards == ["trainer.pt"]
        return
    want = {"tp2": ["trainer-tp0-ep0.pt", "trainer-tp1-ep0.pt"],
            "dp2_ep2": ["trainer-tp0-ep0.pt", "trainer-tp0-ep1.pt"]}[layout]
    assert shards == want
    a, b = (CheckpointManager.load_trainer_state(path, n)["model"] for n in want)
    differ = [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    assert differ, "the two shards hold the same tensors"
    assert sorted(p.name for p in path.glob("optim-rank*.pt")) == [f"optim-rank0000{r}-of00002.pt" for r in (0, 1)]
    # restart from the sharded checkpoint: loads each rank's shard, trains step 3
    more = publish_groups(pub, [synthetic_group(f"mr2-{i}", G, 2, np.random.default_rng(100 + i))
                                for i in range(B)])
    cfg3 = consumer_config(kafka, tiny_model_dir, tmp_path, max_steps=3, **TWO_RANK_LAYOUTS[layout])
    out = _torchrun_consumer(_write_config(tmp_path / "consumer3.yaml", cfg3))
    assert f"resumed from {path.name}" in out
    steps = _committed_steps(tmp_path / "ckpt")
    assert sorted(steps) == [1, 2, 3]
    assert sorted(steps[3]) == sorted(more)