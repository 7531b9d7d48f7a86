"""Hostile run: the real services under every hostile class of issue 36, mixed with valid traffic.

    .venv/bin/python tests/bench/hostile.py                  # 10 minutes, 2 producers (one journaling)
    .venv/bin/python tests/bench/hostile.py --duration-s 120 --cycle-s 40
    .venv/bin/python tests/bench/hostile.py --smoke          # 1 journaling producer, one round of each class

A bench of its own beside tests/bench/soak.py, not an extension of it: the
soak measures throughput, memory and stalls under valid traffic, and those
figures would mean nothing with a broker frozen and thousands of hostile
connections in the run; this one counts what breaks. It shares the soak's
harness (ops/harness/supervisor.py services, the tiny model, tests/support
configs, its drain: fillers flush the last half batch) and its accounting.

Starts its own tansu broker on loopback, one consumer and `--producers` vLLM
producers (the first `--journaling` run multi-turn calculator episodes of 2-4
model turns with the journal on: the drill environment of tests/bench/
episodes.py, since the untrained tiny model never calls the tool). Once the
first step is trained, every `--cycle-s` seconds it sends one round of each
hostile class (tests/bench/_hostile_attacks.py: journal records that are
malformed or dated in the future, unsigned control records, forged weight
announcements, fuzzed rollout records and reused group ids, slow HTTP clients,
connections over the cap, malformed HTTP requests), spread over the cycle; once
in the run, mid-way, it freezes the broker (SIGSTOP for `--freeze-s`, then
SIGCONT). Beside the producers, the bench publishes valid synthetic groups of
its own (the fuzz test's) and, as an operator, changes max_staleness through
the admin API. A poller process (tests/bench/_hostile_probe.py) sends GET
/healthz and /readyz to every service every 0.25 s throughout. A service that
exits is counted and started again (as a supervisor would). Then the producers
drain (SIGTERM), the consumer reads everything and stops, and the topics are
read back. Prints ONE JSON object:

    crashes               service exits during the run (goal 0), each in `crash_log`;
                          `unclean_stops`: services whose SIGTERM stop did not exit 0
    valid_records_lost    valid records on the rollouts topic with no consumer outcome (goal 0):
                          (records - hostile records) - (outcomes - hostile records in the DLQ) - held
    healthz_p99_s         99th percentile of the poller's /healthz and /readyz answer times (goal <= 1);
                          `health`: per path p50/p99/max, answers by code, no answers, cap 503s
    trained_twice         rollout ids in the consumer's audit log more than once (goal 0)
    episodes_published_twice  (group_id, sample_idx) of the producers' records on the topic more than once
    classes               per hostile class: `injected` (by kind) and what the services refused
                          (their /metrics counters at the end, per service; the DLQ by field)
    freeze                the broker freeze: when, how long, which services said unready, and
                          how long after SIGCONT every /readyz answered 200 again
    checks                control settings unchanged by the attacker, no producer ahead of the
                          trainer, no pickle from the topic unpickled, every hostile rollout in
                          the DLQ under its field, no valid record in the DLQ
    goals_met             crashes, valid_records_lost, trained_twice, episodes_published_twice
                          0 and every check true (the exit code: healthz_p99_s is reported, not
                          enforced, a busy machine's latency being no bug)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.bench._smoke import parse_args  # noqa: E402

SMOKE = dict(duration_s=16.0, cycle_s=16.0, producers=1, freeze_s=4.0, lease_s=3.0, slow_clients=20, slow_s=11.0,
             group_timeout_s=10.0)
TURNS = 3
"""Model turns per journaling episode, on average (tests/bench/episodes.py drill_calculator: 2 to 4)."""
PROBE = ROOT / "tests" / "bench" / "_hostile_probe.py"
REFUSAL_METRICS = {
    "rlstream_producer_journal_refused_total": "reason",
    "rlstream_producer_journal_future_times_total": None,
    "rlstream_producer_resumed_episodes_total": "outcome",
    "rlstream_producer_episodes_fenced_total": "at",
    "rlstream_control_unverified_total": "reason",
    "rlstream_control_rejected_total": "topic",
    "rlstream_producer_weight_reload_failures_total": None,
    "rlstream_dlq_records_total": "field",
    "rlstream_consumer_group_reuse_total": None,
    "rlstream_http_refused_total": "reason",
    "rlstream_admin_requests_total": "outcome",
}
"""The counters the report takes from every service's /metrics at the end (by this label)."""
CLASS_METRICS = {
    "journal_malformed": [("rlstream_producer_journal_refused_total", None)],
    "journal_future": [("rlstream_producer_journal_future_times_total", None),
                       ("rlstream_producer_resumed_episodes_total", None),
                       ("rlstream_producer_episodes_fenced_total", None)],
    "control_unsigned": [("rlstream_control_unverified_total", None), ("rlstream_control_rejected_total", {"control"})],
    "weights_forged": [("rlstream_control_rejected_total", {"policy"}),
                       ("rlstream_producer_weight_reload_failures_total", None)],
    "rollouts_fuzz": [("rlstream_dlq_records_total", None), ("rlstream_consumer_group_reuse_total", None)],
    "http_slow": [("rlstream_http_refused_total", {"head_timeout", "body_timeout", "idle_timeout"})],
    "http_over_cap": [("rlstream_http_refused_total", {"connections"})],
    "http_malformed": [("rlstream_http_refused_total", {"json_depth", "head_too_large", "body_too_large"}),
                       ("rlstream_admin_requests_total", {"unauthorized", "invalid"})],
}
"""Where each class's refusals show: (counter, the label values that are the class's; None: all).
`rlstream_control_unverified_total` counts control records and policy messages alike (the
policy topic's refusals are `rlstream_control_rejected_total{topic="policy"}`)."""


@dataclass
class Run:
    args: argparse.Namespace
    tmp: Path
    broker: object
    kafka: object
    ckpt: Path
    model: Path
    consumer: object
    producers: list
    attacker: object = None
    poller: subprocess.Popen | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    crashes: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    timeline: list[dict] = field(default_factory=list)
    phases: dict = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)
    freeze: dict = field(default_factory=dict)
    stops: dict = field(default_factory=dict)
    published: int = 0
    fillers: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    control_state: dict | None = None
    outcomes: dict = field(default_factory=dict)
    held: int | None = None

    @property
    def services(self) -> list:
        return [self.consumer, *self.producers]

    @property
    def targets(self) -> Path:
        return self.tmp / "probe-targets.json"

    @property
    def probes(self) -> Path:
        return self.tmp / "probes.jsonl"


# ---------------------------------------------------------------------------- setup

def worker(argv: list[str]) -> int:
    """A journaling producer: `rlstream producer ...` with the drill calculator (multi-turn episodes)."""
    from rlstream.common.tasks import envs
    from rlstream.cli import main
    from tests.bench.episodes import drill_calculator

    envs.ENVIRONMENTS["calculator"] = drill_calculator(TURNS)
    return main(argv)


def setup(args) -> Run:
    """Tiny model, broker, topics, task data, one config per service; nothing started."""
    from rlstream.harness.supervisor import Service
    from tests.bench.soak import start_broker
    from tests.support.configs import ensure_prompts, service_config, write_config

    G, B = args.group_size, args.groups_per_batch
    tmp, model, broker, kafka = start_broker(args.work_dir, "rlstream-hostile-")
    common = dict(staleness={"max_staleness": 2}, consumer={"group_timeout_s": args.group_timeout_s})
    plain = service_config(kafka, model, tmp, G=G, B=B, **common)
    N, T = 12, 2 * TURNS  # tokens per model turn; the longest episode's turns
    journaling = service_config(kafka, model, tmp, G=G, B=B, **common, producer={
        "max_tokens": N, "episodes": {"env": "calculator", "max_turns": T, "max_turn_tokens": N,
                                      "max_episode_tokens": T * (N + 8)},
        "journal": {"lease_s": args.lease_s}, "drain_timeout_s": 10.0,
        "engine": {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 256}})
    ensure_prompts(plain, n_train=256)
    consumer = Service("consumer", write_config(plain, tmp / "consumer.yaml"), tmp / "logs")
    producers = []
    for i in range(args.producers):
        journals = i < args.journaling
        pc = (journaling if journals else plain).model_copy(deep=True)
        pc.producer.producer_id = f"hostile-p{i}"
        pc.producer.prompts.seed = i
        launch = (lambda argv: [argv[0], __file__, "--worker", *argv[3:]]) if journals else None
        producers.append(Service("producer", write_config(pc, tmp / f"producer-{i}.yaml"), tmp / "logs",
                                 name=f"producer-{i}" + ("-journal" if journals else ""), launch=launch))
    return Run(args, tmp, broker, kafka, Path(plain.consumer.checkpoint_dir), model, consumer, producers)


def warm(run: Run) -> None:
    """Every service up, the first global step trained; the attacker and the poller ready."""
    from tests.bench._hostile_attacks import Attacker
    from tests.bench.soak import start_all
    from tests.support.fuzz_records import MARKER, Live

    start_all(run.services, run.ckpt)
    MARKER.unlink(missing_ok=True)
    run.attacker = Attacker(run.kafka, run.args.group_size, run.model, run.tmp, journaling=run.args.journaling > 0,
                            lease_s=run.args.lease_s, live_fuzz=Live(run.kafka, run.consumer, run.ckpt),
                            admin_url=lambda: run.consumer.url, seed=run.args.seed)
    write_targets(run)
    run.poller = subprocess.Popen([sys.executable, str(PROBE), str(run.targets), str(run.probes)],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)


def write_targets(run: Run) -> None:
    targets = {s.name: s.url for s in run.services if s.alive and s.url}
    tmp = run.targets.with_suffix(".tmp")
    tmp.write_text(json.dumps(targets))
    tmp.replace(run.targets)


# ---------------------------------------------------------------------------- run

def plan(args) -> list[tuple[float, str, int]]:
    """(at seconds, class, round) of every attack: each class once per cycle, spread over it."""
    # the slow clients and the future-dated lease early in the cycle: their effects (the head
    # timeout, the lease judged lapsed and its orphans resumed) take seconds to show
    classes = ["journal_malformed", "http_slow", "journal_future", "control_unsigned", "rollouts_fuzz",
               "weights_forged", "http_over_cap", "http_malformed"]
    cycles = max(1, math.ceil(args.duration_s / args.cycle_s - 1e-9))
    out = [(k * args.cycle_s + i * args.cycle_s / len(classes), name, k)
           for k in range(cycles) for i, name in enumerate(classes)]
    return [e for e in out if e[0] < args.duration_s]


def attack(run: Run, name: str, k: int) -> None:
    """One round of class `name` (round `k`), against the services it aims at."""
    a, args = run.attacker, run.args
    urls = {s.name: s.url for s in run.services if s.alive and s.url}
    if name == "journal_malformed":
        a.journal_malformed(k, huge=k % 3 == 0)  # the 16 MB record every third round: the broker keeps them all
    elif name == "journal_future":
        a.journal_future(k)
    elif name == "control_unsigned":
        a.control_unsigned(k)
    elif name == "weights_forged":
        a.weights_forged(k, trainer_version=trainer_version(run))
    elif name == "rollouts_fuzz":
        a.rollouts_fuzz(k, trainer_version=trainer_version(run))
    elif name == "http_slow":
        a.http_slow(urls, args.slow_clients, seconds=args.slow_s)
    elif name == "http_over_cap":
        names = sorted(urls)
        a.http_over_cap(urls[names[k % len(names)]])
    elif name == "http_malformed":
        for url in urls.values():
            a.http_malformed(url)


def trainer_version(run: Run) -> int:
    v = run.consumer.try_metric("rlstream_consumer_policy_version", 0)
    return 0 if math.isnan(v) else int(v)


def measure(run: Run) -> None:
    """--duration-s of attacks (and the freeze, mid-way), sampling every --sample-s."""
    args = run.args
    events = plan(args)
    freeze_at, resume_at = args.duration_s / 2, None
    t0, next_sample = time.monotonic(), 0.0
    run.t_start = time.time()
    while True:
        el = time.monotonic() - t0
        if resume_at is None and freeze_at is not None and el >= freeze_at:
            run.broker.pause()
            run.freeze = {"at_s": round(el, 1), "paused": time.time()}
            resume_at, freeze_at = el + args.freeze_s, None
        elif resume_at is not None and el >= resume_at:
            run.broker.resume()
            run.freeze.update(resumed=time.time(), seconds=round(time.time() - run.freeze["paused"], 2))
            resume_at = None
        elif resume_at is None and events and events[0][0] <= el:
            _, name, k = events.pop(0)
            t = time.monotonic()
            try:
                attack(run, name, k)
            except Exception as e:  # noqa: BLE001 - an attack that fails is reported, the run goes on
                run.errors.append(f"{name} round {k}: {type(e).__name__}: {e}: "
                                  f"{traceback.format_exc(limit=3)[-600:]}")
            run.timeline.append({"at_s": round(el, 1), "class": name, "round": k,
                                 "took_s": round(time.monotonic() - t, 2)})
        if el >= next_sample:
            sample(run, el)
            next_sample = el + args.sample_s
        if el >= args.duration_s and not events and resume_at is None and freeze_at is None:
            break
        time.sleep(0.05)
    run.t_end = time.time()


def sample(run: Run, el: float) -> None:
    """Crashes (a service that exited is counted and started again), versions, lag."""
    for s in run.services:
        if s.started and not s.alive:
            run.crashes.append({"service": s.name, "at_s": round(el, 1), "code": s.returncode,
                                "log_tail": s.log_tail(1500)})
            s.start()
    if not run.broker.is_running():
        run.crashes.append({"service": "broker", "at_s": round(el, 1), "log_tail": run.broker.log_tail(1500)})
    write_targets(run)
    c = run.consumer
    # the producers first: the trainer's version, read after them, only grows, so a producer
    # above it was ahead of the trainer
    producer_versions = {p.name: p.try_metric("rlstream_producer_policy_version") for p in run.producers}
    run.samples.append({"t": round(el, 1), "producer_versions": producer_versions,
                        "version": c.try_metric("rlstream_consumer_policy_version"),
                        "lag": c.try_metric("rlstream_consumer_lag_records")})


# ---------------------------------------------------------------------------- drain

def drain(run: Run) -> None:
    """Stop the poller and the attacks; producers finish, the consumer reads everything and stops."""
    from rlstream.common.errors import PipelineError
    from rlstream.harness.observe import http_request, parse
    from rlstream.harness.supervisor import wait_until
    from tests.support.configs import ADMIN_TOKEN
    from tests.support.feeder import flush_half_batch

    stop_poller(run)
    run.attacker.close()  # the slow clients' threads end
    c = run.consumer
    for p in run.producers:
        run.metrics[p.name] = _scrape(p, parse)
        run.stops[p.name] = p.stop(timeout_s=180)
        final = p.final()
        run.published += int(final["published"]) if final else 0
    try:
        wait_until(lambda: c.try_metric("rlstream_consumer_lag_records") == 0
                   and c.try_metric("rlstream_consumer_open_groups") == 0, 300, "drained", [c], interval_s=0.5)
        flush_half_batch(run.kafka, run.ckpt, c, run.args.group_size, run.args.groups_per_batch,
                         on_publish=run.fillers.extend)
        wait_until(lambda: c.try_metric("rlstream_consumer_lag_records") == 0, 60, "drained", [c])
    except PipelineError as e:
        run.errors.append(f"drain: {e}"[:2000])
    run.metrics[c.name] = _scrape(c, parse)
    try:
        code, body = http_request(c.url + "/admin/control", token=ADMIN_TOKEN)
        run.control_state = json.loads(body) if code == 200 else None
    except OSError:
        pass
    run.stops[c.name] = c.stop(timeout_s=180)
    final = c.final() or {}
    run.outcomes, run.held = final.get("outcomes", {}), final.get("held")


def stop_poller(run: Run) -> None:
    if run.poller is not None and run.poller.poll() is None:
        run.poller.terminate()
        try:
            run.poller.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(run.poller.pid, signal.SIGKILL)


def _scrape(service, parse) -> dict:
    try:
        return parse(service.scrape())
    except Exception:  # noqa: BLE001 - a service that does not answer: no counters
        return {}


# ---------------------------------------------------------------------------- report

def report(run: Run) -> dict:
    from tests.support.fuzz_records import MARKER
    from tests.support.audit import audit_steps

    args, a = run.args, run.attacker
    records, dlq = read_back(run)
    hostile = a.live.expected  # DLQ source -> (kind, field) of every hostile rollout record
    letters = {d.source: d for d in dlq}
    found = {s: letters[s] for s in hostile if s in letters}
    outcomes = {k: int(v) for k, v in run.outcomes.items()}
    held = int(run.held or 0)
    valid_lost = (len(records) - len(hostile)) - (sum(outcomes.values()) - len(found)) - held
    trained = [rid for ids in audit_steps(run.ckpt).values() for rid in ids]
    ours = [r for r in records if r is not None and r.producer_id not in ("synthetic", "reuser")
            and r.group_id != "tmpl"]
    twice = sum(1 for n in Counter((r.group_id, r.sample_idx) for r in ours).values() if n > 1)
    rollouts = run.kafka.topics.rollouts
    ahead = producers_ahead(run)
    checks = {
        "control_settings_unchanged": control_intact(run),
        "no_producer_ahead_of_trainer": not ahead,
        "no_pickle_unpickled": not MARKER.exists(),
        "hostile_rollouts_all_in_dlq": len(found) == len(hostile),
        "hostile_rollouts_dlq_field_right": all(d.field == hostile[s][1] for s, d in found.items()),
        "no_valid_record_in_dlq": not [s for s in letters if s.startswith(rollouts + "/") and s not in hostile],
    }
    result = {
        "bench": "hostile", "smoke": args.smoke, "duration_s": round(run.t_end - run.t_start, 1),
        "producers": args.producers, "journaling": args.journaling, "G": args.group_size,
        "B": args.groups_per_batch,
        "crashes": len(run.crashes), "valid_records_lost": valid_lost,
        "healthz_p99_s": None, "trained_twice": len(trained) - len(set(trained)),
        "episodes_published_twice": twice,
        "unclean_stops": {k: v for k, v in run.stops.items() if v != 0},
        "records": {"on_topic": len(records), "hostile": len(hostile), "producers_published": run.published,
                    "bench_valid": a.live.valid_groups * args.group_size, "fillers": len(run.fillers),
                    "outcomes": outcomes, "held": held, "steps": max(audit_steps(run.ckpt), default=0)},
        "health": health(run),
        "freeze": freeze_report(run),
        "classes": classes(run, dlq, found, records),
        "checks": checks, "producers_ahead": ahead[:5],
        "phases_s": run.phases, "timeline": run.timeline,
        "crash_log": run.crashes, "errors": run.errors, "work_dir": str(run.tmp),
    }
    result["healthz_p99_s"] = result["health"]["all"]["p99_s"]
    result["goals_met"] = (result["crashes"] == 0 and valid_lost == 0 and result["trained_twice"] == 0
                           and twice == 0 and all(checks.values()))
    return result


def read_back(run: Run) -> tuple[list, list]:
    """Every record of the rollouts topic (None where it does not decode) and the DLQ."""
    from rlstream.harness.census import read_dlq, read_topic
    from rlstream.common.record import Rollout, decode_any

    records = []
    for m in read_topic(run.kafka, run.kafka.topics.rollouts, to_end=True, timeout_s=300):
        try:
            r = decode_any(m.value)
        except Exception:  # noqa: BLE001 - a hostile record: counted, not decoded
            r = None
        records.append(r if isinstance(r, Rollout) else None)
    return records, read_dlq(run.kafka, to_end=True, timeout_s=120)


def control_intact(run: Run) -> bool:
    """The consumer's settings and every producer's are the configured ones (the operator's
    changes end where they began): no unsigned or replayed record applied."""
    want = {"max_staleness": 2, "decay": 1.0, "paused": False}
    if run.control_state is None or any(run.control_state.get(k) != v for k, v in want.items()):
        return False
    for p in run.producers:
        m = run.metrics.get(p.name) or {}
        got = {k: m.get(("rlstream_control_setting", (("key", k),))) for k in want}
        if got["paused"] not in (None, 0.0) or got["max_staleness"] not in (None, 2.0) or got["decay"] not in (None, 1.0):
            return False
    return True


def producers_ahead(run: Run) -> list[dict]:
    """The samples in which a producer served a version the trainer had not reached (none wanted)."""
    return [x for x in run.samples if not math.isnan(x["version"])
            and any(pv > x["version"] for pv in x["producer_versions"].values() if not math.isnan(pv))]


def counters(parsed: dict, name: str, label: str | None) -> dict | float:
    """{label value: value} of counter `name` (its total without a label); zeros left out."""
    if label is None:
        return sum(v for (n, _), v in parsed.items() if n == name)
    out = {dict(labels).get(label, "?"): v for (n, labels), v in parsed.items() if n == name and v}
    return {k: int(v) if float(v).is_integer() else v for k, v in sorted(out.items())}


def classes(run: Run, dlq: list, found: dict, records: list) -> dict:
    """Per class: what was injected, and what each service's counters say it refused."""
    a = run.attacker
    refused = {s: {m: counters(run.metrics.get(s, {}), m, label) for m, label in REFUSAL_METRICS.items()}
               for s in [x.name for x in run.services]}
    out = {}
    for name, metrics in CLASS_METRICS.items():
        mine = {s: {m: _only(refused[s][m], labels) for m, labels in metrics} for s in refused}
        out[name] = {"injected": dict(a.injected.get(name, {})),
                     "refused": {s: {m: v for m, v in ms.items() if v} for s, ms in mine.items()}}
    journal = run.attacker.journal.topic if run.attacker.journal is not None else None
    out["journal_malformed"]["dlq_by_field"] = dict(Counter(
        d.field for d in dlq if journal and d.source.startswith(journal + "/")))
    ghosts = Counter(r.group_id for r in records if r is not None and r.group_id in a.ghosts)
    epochs = Counter(r.claim_epoch for r in records if r is not None
                     and f"ep:{r.group_id}#{r.sample_idx}" in set(a.forged_claims))
    out["journal_future"].update(ghost_groups_resumed={"injected": len(a.ghosts), "records_published": sum(
        ghosts.values()), "complete_groups": sum(n == run.args.group_size for n in ghosts.values())},
        forged_claim_keys_published_by_epoch=dict(epochs))
    out["rollouts_fuzz"].update(in_dlq=len(found), hostile_records=len(a.live.expected),
                                not_in_dlq_by_kind=dict(Counter(k for s, (k, _) in a.live.expected.items()
                                                                if s not in found)),
                                valid_groups_beside=a.live.valid_groups)
    out["broker_freeze"] = {"injected": {"SIGSTOP": 1 if run.freeze else 0}}
    return out


def _only(value, labels: set[str] | None):
    return value if labels is None or not isinstance(value, dict) else {k: v for k, v in value.items() if k in labels}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)], 3)


def probes(run: Run) -> list[dict]:
    try:
        lines = run.probes.read_text().splitlines()
    except OSError:
        return []
    out = []
    for x in lines:
        try:
            out.append(json.loads(x))
        except ValueError:
            continue  # the last line, cut by the poller's stop
    return [p for p in out if run.t_start <= p["t"] <= run.t_end]


def health(run: Run) -> dict:
    """The poller's answers: times by path, codes, no answers, the connection cap's 503s."""
    ps = probes(run)

    def stats(sel: list[dict]) -> dict:
        secs = [p["s"] for p in sel]
        return {"probes": len(sel), "p50_s": _pct(secs, 0.5), "p99_s": _pct(secs, 0.99),
                "max_s": round(max(secs), 3) if secs else None, "over_1s": sum(s > 1.0 for s in secs),
                "codes": dict(Counter(str(p["code"]) for p in sel)), "over_cap_503": sum("over_cap" in p for p in sel)}

    freeze = (run.freeze.get("paused", math.inf), run.freeze.get("resumed", math.inf) + 5.0)
    healthz = [p for p in ps if p["path"] == "/healthz"]
    slowest = sorted(ps, key=lambda p: -p["s"])[:5]
    return {"all": stats(ps), "/healthz": stats(healthz), "/readyz": stats([p for p in ps if p["path"] == "/readyz"]),
            "slowest": [{"at_s": round(p["t"] - run.t_start, 1), "svc": p["svc"], "path": p["path"],
                         "code": p["code"], "s": p["s"]} for p in slowest],
            "healthz_non_200_outside_cap": sum(p["code"] != 200 and "over_cap" not in p for p in healthz),
            "readyz_non_200_outside_freeze": sum(p["code"] != 200 and "over_cap" not in p
                                                 and not freeze[0] <= p["t"] <= freeze[1]
                                                 for p in ps if p["path"] == "/readyz")}


def freeze_report(run: Run) -> dict:
    """Which services said unready while the broker was frozen, and when each was ready again."""
    if not run.freeze.get("resumed"):
        return {"done": False}
    paused, resumed = run.freeze["paused"], run.freeze["resumed"]
    ready = [p for p in probes(run) if p["path"] == "/readyz"]
    out = {"at_s": run.freeze["at_s"], "seconds": run.freeze["seconds"], "unready_while_frozen": {},
           "ready_again_after_s": {}}
    for svc in sorted({p["svc"] for p in ready}):
        mine = [p for p in ready if p["svc"] == svc]
        out["unready_while_frozen"][svc] = any(p["code"] == 503 and "over_cap" not in p
                                               for p in mine if paused <= p["t"] <= resumed + 1.0)
        after = [p["t"] for p in mine if p["t"] > resumed and p["code"] == 200]
        out["ready_again_after_s"][svc] = round(after[0] - resumed, 2) if after else None
    return out


# ---------------------------------------------------------------------------- main

def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=600.0, help="attack time before the drain (default 600)")
    ap.add_argument("--cycle-s", type=float, default=60.0, help="one round of every class per cycle")
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--journaling", type=int, default=1, help="of the producers, how many run journaled episodes")
    ap.add_argument("--freeze-s", type=float, default=8.0, help="the broker freeze (SIGSTOP), once, mid-run")
    ap.add_argument("--lease-s", type=float, default=10.0, help="producer.journal.lease_s of the journaling producers")
    ap.add_argument("--slow-clients", type=int, default=70, help="slow-header clients per service per round")
    ap.add_argument("--slow-s", type=float, default=32.0,
                    help="how long the slow clients trickle (past the 10 s head and 30 s body timeouts)")
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--groups-per-batch", type=int, default=2)
    ap.add_argument("--group-timeout-s", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=None, help="keep logs here (default: a temp dir)")
    args = parse_args(ap, SMOKE)
    if args.group_size != 4:
        ap.error("--group-size must be 4: the fuzz generator's records are of groups of 4")

    import logging

    logging.basicConfig(level=logging.WARNING)
    t, load0 = time.monotonic(), os.getloadavg()[0]
    run = setup(args)
    run.phases["setup"], t = round(time.monotonic() - t, 1), time.monotonic()
    try:
        for phase in (warm, measure, drain):
            phase(run)
            run.phases[phase.__name__], t = round(time.monotonic() - t, 1), time.monotonic()
        result = report(run)
        run.phases["report"] = round(time.monotonic() - t, 1)  # (the result holds this dict)
        result["loadavg_1min"] = {"start": round(load0, 2), "end": round(os.getloadavg()[0], 2)}
    finally:
        stop_poller(run)
        for s in run.services:
            if s.alive:
                s.kill()
        run.broker.stop()  # (SIGCONT first: never left stopped)
    print(json.dumps(result))
    return 0 if result["goals_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
