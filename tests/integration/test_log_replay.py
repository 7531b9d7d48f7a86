"""`rlstream replay` reproduces a live run from the log, bit for bit on CPU.

The real consumer (the service's loop, Megatron-core, the tiny model) trains N steps from the real broker in reweight mode; half-way the
staleness settings change on the control topic (decay and max_staleness),
so the second half's sample weights differ from the first's. Some records
travel as claim checks. `rlstream replay` (in this process) trains the same
steps again from the audit log's step records, from step 0 and from a
checkpoint of the run; the test compares every step's metrics and every model
and optimizer tensor with the run's own, exactly.
Then one claim-checked record's blob is deleted: the replay fails with an
error naming the record and the blob.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rlstream.harness.supervisor import wait_until
from rlstream.common.kafka.publisher import RolloutPublisher
from tests.fixtures.kafka import make_kafka_settings
from tests.support.audit import audit_lines, lineage_entries
from tests.support.configs import service_config, trainer_writer, write_config
from tests.support.synthetic import publish_groups, synthetic_group

pytestmark = [pytest.mark.broker, pytest.mark.megatron]

G, B, N = 4, 2, 6


def _groups(tag: str, rng, n: int) -> list:
    """n groups of dispatch version 0 (they age one step per step); every third one's prompt
    is long enough for its records to go through the claim check (> 2 KiB)."""
    return [synthetic_group(f"{tag}-{i}", G, 0, rng, prompt_len=300 if i % 3 == 0 else 5) for i in range(n)]


@pytest.fixture(scope="module")
def live_run(broker, tiny_model_dir, tmp_path_factory):
    """The consumer service's own loop (`ConsumerService.run`, in this process: no second
    Megatron start-up) trains N steps and stops at max_steps; a thread feeds it the first
    half, changes the staleness settings once those steps are trained, then feeds the rest."""
    import signal
    import threading

    from rlstream.consumer.service import ConsumerService

    tmp = tmp_path_factory.mktemp("log-replay")
    kafka = make_kafka_settings(broker.bootstrap, tmp / "blobs", rollouts_partitions=2, claim_check_bytes=2048)
    cfg = service_config(kafka, tiny_model_dir, tmp, G=G, B=B,
                         staleness={"max_staleness": 8, "mode": "reweight", "decay": 0.9},
                         consumer={"max_steps": N, "checkpoint": {"every_steps": 2}})
    path = write_config(cfg, tmp / "config.yaml")
    ckpt = Path(cfg.consumer.checkpoint_dir)
    rng = np.random.default_rng(3)
    svc = ConsumerService(cfg, broker.bootstrap)
    errors: list[BaseException] = []

    def feed() -> None:
        try:
            with RolloutPublisher(kafka) as pub:
                publish_groups(pub, _groups("first", rng, B * N // 2))
                wait_until(lambda: audit_lines(ckpt) >= N // 2 or svc._stop, 240, "the first half's steps")
                writer = trainer_writer(kafka)  # half-way: acknowledged before the next batch boundary
                writer.set_control("decay", 0.5, by="test")
                writer.set_control("max_staleness", 6, by="test")
                writer.close()
                publish_groups(pub, _groups("second", rng, B * N // 2))
        except BaseException as e:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(e)
            svc.stop()

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    watchdog = threading.Timer(400, svc.stop)  # a stuck run ends; the assertions below say why
    watchdog.start()
    try:
        assert svc.run() == 0
    finally:
        watchdog.cancel()
        for sig, h in handlers.items():
            signal.signal(sig, h)
        feeder.join(60)
    assert not errors, errors
    assert audit_lines(ckpt) == N, "the run stopped before max_steps"
    return cfg, path, tmp


def _replay(path: Path, out: Path, capsys) -> tuple[int, str, str]:
    from rlstream.cli import main

    capsys.readouterr()
    code = main(["replay", "-c", str(path), "--out", str(out)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.mark.timeout(600)
def test_replay_equals_the_live_run(live_run, capsys):
    import torch

    cfg, path, tmp = live_run
    ckpt = Path(cfg.consumer.checkpoint_dir)
    lines = lineage_entries(ckpt)
    assert sorted(lines) == list(range(1, N + 1))
    controls = [lines[s]["inputs"]["control"] for s in sorted(lines)]
    assert controls[0]["decay"] == 0.9 and controls[-1]["decay"] == 0.5, controls  # the change is recorded
    assert any(max(lines[s]["inputs"]["staleness"]) > 0 for s in lines)  # reweighting mattered

    code, out, err = _replay(path, tmp / "replay", capsys)
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and summary["replay_equal"], (summary, err[-3000:])
    assert summary["steps"] == N and summary["params_equal"] is True

    # independently of the command's own comparison: every step's metrics, every tensor
    replayed = [json.loads(x) for x in (tmp / "replay" / "replay.jsonl").read_text().splitlines()]
    assert [r["step"] for r in replayed] == list(range(1, N + 1))
    for r in replayed:
        assert json.dumps(r["metrics"], sort_keys=True) == json.dumps(lines[r["step"]]["inputs"]["metrics"],
                                                                      sort_keys=True), r["step"]
    mine = torch.load(tmp / "replay" / f"step-{N:08d}" / "trainer.pt", weights_only=True)["model"]
    theirs = torch.load(ckpt / f"step-{N:08d}" / "trainer.pt", weights_only=True)["model"]
    assert set(mine) == set(theirs) and mine
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), [k for k in mine if not torch.equal(mine[k], theirs[k])]


@pytest.mark.timeout(600)
def test_replay_from_a_checkpoint_of_the_run(live_run, capsys):
    from rlstream.cli import main

    cfg, path, tmp = live_run
    start = Path(cfg.consumer.checkpoint_dir) / f"step-{N - 2:08d}"  # every_steps 2: the one before the last
    capsys.readouterr()
    code = main(["replay", "-c", str(path), "--out", str(tmp / "replay-from"), "--from", str(start)])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and summary["replay_equal"] and summary["params_equal"] is True, summary
    assert (summary["first_step"], summary["steps"]) == (N - 2, 2)


@pytest.mark.timeout(600)
def test_replay_fails_naming_a_record_whose_blob_is_gone(live_run, capsys):
    from rlstream.common.kafka.claimcheck import BlobStore
    from rlstream.common.kafka.scan import TopicScan
    from rlstream.common.record import ClaimPointer, decode_any

    cfg, path, tmp = live_run
    with TopicScan(cfg.kafka, cfg.kafka.topics.rollouts) as scan:
        pointers = []
        while not all(scan.done(p) for p in scan.partitions):
            for m in scan.poll():
                if isinstance(r := decode_any(m.value), ClaimPointer):
                    pointers.append((m.partition, m.offset, r))
    assert pointers
    p, o, victim = pointers[0]
    blob = next(b for b in BlobStore(cfg.kafka.blob_dir).blobs() if b.name == victim.sha256)
    blob.path.unlink()
    code, _, err = _replay(path, tmp / "replay-gone", capsys)
    assert code == 2
    assert f"{cfg.kafka.topics.rollouts}/{p}/{o}" in err and victim.rollout_id in err, err[-2000:]
    assert victim.sha256[:12] in err and "claim check" in err, err[-2000:]
