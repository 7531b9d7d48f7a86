"""Durable episodes under crashes (issue 25, item 2): what a SIGKILL costs with and without the journal.

    .venv/bin/python tests/bench/episodes.py                 # 10 crashes, one every 30 s (~14 min)
    .venv/bin/python tests/bench/episodes.py --smoke         # 2 crashes, 10 s apart (3 engine starts: ~4 min)

Two producer processes (real vLLM CPU engines on the tiny model, the bundled
broker) run calculator episodes. Every `--interval-s` seconds producer p2 is
SIGKILLed and restarted; p1 stays up. Durability is on and off in turn, in the
same run: "on", the journal's orphans are resumed (by p1 after the lease, or by
the restarted p2 at once); "off", no producer resumes (a flag file the workers
read) and the bench tombstones the dead process's entries, which is what a
producer without a journal loses. Both arms journal, so both are measured the
same way: at a kill, every entry the dead incarnation still held is an episode
in flight; it loses (kill time - its last journal write) if it is resumed and
published (the turn that was generating), else (kill time - its first write,
the episode's start). Summed over the crash's episodes: trajectory-generation
seconds, the unit of verl's journal RFC (concurrent episodes each count).

The environment is the calculator's (observations are its worked solution's,
the final turn scored by the task) for a number of turns fixed by the task, from
turns/2 to 3*turns/2: the random tiny model never calls the tool, a one-turn
episode has nothing to resume, and episodes of one length would run in lockstep,
so a kill's lost seconds would hang on where in that lockstep it fell.

The bench also checks what the issue's crash test asks (tests/integration/
test_episode_crash.py runs `--smoke` and asserts it): every episode the killed
process held is published exactly once (on the "on" arm), and each resumed record
starts with exactly the tokens the killed process had journaled.

Prints ONE JSON object:
    lost_generation_seconds_per_crash   {"on": s, "off": s}: mean over that arm's crashes
    lost_ratio_on_over_off              goal <= 0.2
    lost_ratio_paired                   over every crash's episodes (both arms journal): time since the last
                                        durable write / time since the start; what the journal saves for the
                                        same episodes, free of the arms' different crashes
    episodes_published_twice            (group_id, sample_idx) more than once in the rollouts topic; goal 0
    crashes                             per crash: arm, episodes in flight, lost seconds, resumed+published
    published_twice_under_two_rollout_ids   of those, copies the consumer's rollout-id check cannot skip
    records, resumed_unpublished        records in the topic; on-arm orphans never published by the end
    resumed_prefix_mismatches           on-arm orphans whose record does not start with the journaled tokens
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench._smoke import parse_args  # noqa: E402

SMOKE = dict(crashes=2, interval_s=10.0, group_size=2, turns=3, lease_s=2.0)


# ----------------------------------------------------------------------- worker

def episode_turns(prompt: str, turns: int) -> int:
    """Model turns of the episode of `prompt`: turns/2 to 3*turns/2, fixed by the prompt (a replay agrees)."""
    low = max(2, turns // 2)
    return low + zlib.crc32(prompt.encode()) % (2 * turns - 2 * low + 1)


def drill_calculator(turns: int):
    """The calculator for `episode_turns` model turns: its worked solution's observations in between."""
    from rlstream.common.tasks.envs.calculator import CalculatorEnv, reference_turns
    from rlstream.common.tasks.environment import StepResult

    class DrillCalculator(CalculatorEnv):
        def reset(self, task):
            self.turn, self.turns = 0, episode_turns(task.prompt, turns)
            self.observations = [t for t, model in reference_turns(task.prompt) or [] if not model] or ["=err,"]
            return super().reset(task)

        def step(self, turn):
            self.turn += 1
            if self.turn < self.turns:
                self.calls += 1
                return StepResult(self.observations[(self.turn - 1) % len(self.observations)])
            reward, info = self.task.score(turn.text.strip())
            return StepResult(None, float(reward), True, {**info, "tool_calls": self.calls})

    return DrillCalculator


def worker(config: str, flag: str, turns: int) -> int:
    """One producer process: the drill environment, resumption only while `flag` exists."""
    from rlstream.common.tasks import envs
    from rlstream.cli import main
    from rlstream.producer.journal import Resumer

    envs.ENVIRONMENTS["calculator"] = drill_calculator(turns)
    resume = Resumer.tick
    Resumer.tick = lambda self, *view: resume(self, *view) if os.path.exists(flag) else 0
    return main(["producer", "-c", config])


# ------------------------------------------------------------------------ bench

class Watch:
    """The journal as the bench reads it: newest entry per key, and each key's first write."""

    def __init__(self, kafka, lease_s: float):
        from rlstream.producer.journal.topic import JournalTopic

        class Topic(JournalTopic):
            def _fold(inner, key, value, *rest):  # noqa: N805 - the bench's view of the fold
                super()._fold(key, value, *rest)
                if key in inner.entries and key not in self.first:
                    self.first[key] = inner.entries[key].written_at

        self.first: dict[str, float] = {}
        self.topic = Topic(kafka, lease_s)

    def incarnation(self, pid: str) -> str | None:
        self.topic.sync()
        lease = self.topic.leases.get(pid)
        return lease.incarnation if lease else None


def setup(args, tmp: Path):
    from rlstream.common.config import BrokerSettings
    from rlstream.common.control.messages import TrainerProgress
    from rlstream.common.kafka.broker import EmbeddedBroker
    from rlstream.toy.tinymodel import build_tiny_model
    from tests.fixtures.kafka import make_kafka_settings
    from tests.support.configs import ensure_prompts, service_config, trainer_writer, write_config

    G, T, N = args.group_size, 2 * args.turns, args.turn_tokens  # T: the longest episode's turns
    model = build_tiny_model(tmp / "tiny-model")
    broker = EmbeddedBroker(BrokerSettings(port=0)).start()
    kafka = make_kafka_settings(broker.bootstrap, tmp / "blobs", rollouts_partitions=2)
    episodes = {"env": "calculator", "max_turns": T, "max_turn_tokens": N, "max_episode_tokens": T * (N + 8)}
    cfg = service_config(kafka, model, tmp, G=G, B=1024, staleness={"max_staleness": 1000}, producer={
        "max_tokens": N, "max_groups_in_flight": args.groups_in_flight, "episodes": episodes,
        "journal": {"lease_s": args.lease_s}, "drain_timeout_s": 5.0,
        "engine": {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 256}})
    ensure_prompts(cfg, n_train=4096)
    progress = TrainerProgress(trainer_version=0, groups_per_batch=1024, group_size=G)  # no trainer: never held back
    w = trainer_writer(kafka)  # the producers apply only signed announcements
    w.announce(progress)
    w.close()
    paths = {}
    for pid in ("p1", "p2"):
        c = cfg.model_copy(deep=True)
        c.producer.producer_id = pid
        c.producer.prompts.seed = int(pid[1])
        paths[pid] = write_config(c, tmp / f"{pid}.yaml")
    return broker, kafka, paths


def start(pids: list[str], paths, flag: Path, args, tmp: Path, watch: Watch, old: str | None = None) -> dict:
    """Producer processes, started together; returns once each one's lease (a new incarnation)
    is in the journal (written once its engine is up: it generates from then on)."""
    procs = {}
    for pid in pids:
        log = open(tmp / f"{pid}.log", "a")
        procs[pid] = subprocess.Popen([sys.executable, __file__, "--worker", str(paths[pid]), "--flag", str(flag),
                                       "--turns", str(args.turns)], stdout=log, stderr=subprocess.STDOUT,
                                      env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                                      start_new_session=True)
    deadline = time.time() + 300
    for pid, proc in procs.items():
        while watch.incarnation(pid) in (None, old):
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"producer {pid} did not start (exit {proc.poll()}); see {tmp / f'{pid}.log'}")
            time.sleep(0.5)
    return procs


def crash(pid: str, proc, watch: Watch) -> dict:
    """SIGKILL `pid`; its unfinished episodes: key -> (rollout id, first write, last write, journaled
    tokens), kill time."""
    from rlstream.producer.journal.snapshot import decode

    inc = watch.incarnation(pid)
    os.killpg(proc.pid, signal.SIGKILL)
    t_kill = time.time()
    proc.wait()
    watch.topic.sync()  # everything the dead process wrote
    held = {k: e for k, e in watch.topic.entries.items() if e.holder == pid and e.incarnation == inc}
    snaps = {k: decode(watch.topic.snapshots[k]) for k in held}
    return {"t": t_kill, "incarnation": inc, "episodes": {
        k: (snaps[k].rollout_id, watch.first[k], e.written_at, snaps[k].response.tolist()) for k, e in held.items()}}


def lost_seconds(c: dict, published: set[str]) -> tuple[float, int]:
    """(trajectory-seconds lost, episodes resumed and published) of one crash."""
    lost, saved = 0.0, 0
    for rid, first, last, _ in c["episodes"].values():
        resumed = c["arm"] == "on" and rid in published
        lost += c["t"] - (last if resumed else first)
        saved += resumed
    return lost, saved


def run(args) -> dict:
    from tests.support.topics import read_valid_rollouts

    tmp = Path(args.work_dir or tempfile.mkdtemp(prefix="rlstream-episodes-"))
    tmp.mkdir(parents=True, exist_ok=True)
    broker, kafka, paths = setup(args, tmp)
    flag = tmp / "resume-on"
    flag.touch()
    watch = Watch(kafka, args.lease_s)
    procs, crashes = {}, []
    try:
        procs = start(["p1", "p2"], paths, flag, args, tmp, watch)
        for k in range(args.crashes):
            arm = "on" if k % 2 == 0 else "off"
            flag.touch() if arm == "on" else flag.unlink(missing_ok=True)
            time.sleep(args.interval_s)
            c = {"arm": arm, **crash("p2", procs["p2"], watch)}
            if arm == "off":  # without a journal these are gone: nobody may resume them
                for key in c["episodes"]:
                    watch.topic.tombstone(key)
                watch.topic.flush()
                time.sleep(1.0)  # the workers fold the tombstones before the flag may return
            crashes.append(c)
            if k + 1 < args.crashes:  # after the last crash p1 alone finishes (an engine start saved)
                procs.update(start(["p2"], paths, flag, args, tmp, watch, old=c["incarnation"]))
            else:
                del procs["p2"]
        flag.touch()
        time.sleep(args.lease_s + args.interval_s / 2)  # the last on-arm orphans resumed and finished
        for proc in procs.values():
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            proc.wait(timeout=120)
        records = read_valid_rollouts(kafka)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        watch.topic.close()
        broker.stop()
    return report(args, crashes, records)


def report(args, crashes: list[dict], records) -> dict:
    published = {r.rollout_id for r in records}
    by_id = {r.rollout_id: r for r in records}
    per_arm: dict[str, list[float]] = {"on": [], "off": []}
    rows, unpublished, mismatches = [], 0, 0
    for c in crashes:
        lost, saved = lost_seconds(c, published)
        per_arm[c["arm"]].append(lost)
        if c["arm"] == "on":
            unpublished += len(c["episodes"]) - saved
            for rid, _, _, tokens in c["episodes"].values():  # what the killed process made, as journaled
                r = by_id.get(rid)
                mismatches += r is not None and r.response_ids[:len(tokens)].tolist() != tokens
        eps = c["episodes"].values()  # how old the episodes and their durable turns were at the kill
        rows.append({"arm": c["arm"], "in_flight": len(c["episodes"]), "lost_s": round(lost, 2),
                     "resumed_published": saved,
                     "mean_episode_age_s": round(sum(c["t"] - e[1] for e in eps) / max(1, len(eps)), 2),
                     "mean_since_last_write_s": round(sum(c["t"] - e[2] for e in eps) / max(1, len(eps)), 2)})
    mean = {arm: (sum(v) / len(v) if v else None) for arm, v in per_arm.items()}
    ids: dict[tuple, set] = {}
    for r in records:
        ids.setdefault((r.group_id, r.sample_idx), set()).add(r.rollout_id)
    since_start = sum(c["t"] - e[1] for c in crashes for e in c["episodes"].values())
    since_write = sum(c["t"] - e[2] for c in crashes for e in c["episodes"].values())
    twice = sum(1 for n in Counter((r.group_id, r.sample_idx) for r in records).values() if n > 1)
    other_ids = sum(1 for v in ids.values() if len(v) > 1)  # a copy the consumer could not dedup
    return {"lost_generation_seconds_per_crash": {a: round(v, 2) if v is not None else None for a, v in mean.items()},
            "lost_ratio_on_over_off": round(mean["on"] / mean["off"], 3) if mean["on"] is not None and mean["off"]
            else None,
            "lost_ratio_paired": round(since_write / since_start, 3) if since_start else None,
            "episodes_published_twice": twice, "published_twice_under_two_rollout_ids": other_ids, "crashes": rows, "records": len(records),
            "resumed_unpublished": unpublished, "resumed_prefix_mismatches": mismatches,
            "interval_s": args.interval_s, "lease_s": args.lease_s,
            "group_size": args.group_size, "turns": args.turns, "smoke": args.smoke}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--crashes", type=int, default=10, help="SIGKILLs of p2, arms on/off in turn (on first)")
    ap.add_argument("--interval-s", type=float, default=30.0, help="seconds p2 runs before each SIGKILL")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--groups-in-flight", type=int, default=4)
    ap.add_argument("--turns", type=int, default=10, help="model turns per episode, on average (turns/2 to 3*turns/2)")
    ap.add_argument("--turn-tokens", type=int, default=12)
    ap.add_argument("--lease-s", type=float, default=3.0)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--flag", default=None, help=argparse.SUPPRESS)
    args = parse_args(ap, SMOKE)
    if args.worker:
        sys.exit(worker(args.worker, args.flag, args.turns))
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
