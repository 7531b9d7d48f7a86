"""`rlstream demo`: the whole pipeline, end to end, on one CPU machine.

    make demo          # = rlstream demo -c configs/tiny-cpu.yaml

Steps (docs/demo.md has the measured timings):

    prepare   build the tiny MoE + tokenizer and the arithmetic task (common/toy/build.py),
              warm-start it by SFT until it solves a minority of held-out problems
              (common/harness/sft.py; reused when inputs are unchanged)
    start     `rlstream broker`, N x `rlstream producer`, one `rlstream consumer`,
              each a separate process with its own log, env and HTTP port, all
              pointed at the broker with --set kafka.bootstrap_servers=...
    watch     every few seconds: scrape /metrics of every service, print one
              progress line (version, reward, held-out accuracy, KL, staleness,
              samples/s), append it to progress.jsonl; evaluate the newest weight
              version's held-out accuracy (greedy, common/harness/evaluate.py)
    stop      when accuracy >= warm + demo.target_gain on two evaluations in a
              row, or at demo.max_minutes: SIGTERM producers (they drain), let the
              consumer take in the rest, SIGTERM it, then the broker; check that
              every process exited 0 and account for every published record
    report    report.md + PNG plots (common/harness/report.py)

The orchestration pieces (`prepare_warm`, `Pipeline`, `run_rl`) are reused by
`rlstream experiment` (common/harness/experiments.py) and the end-to-end test.
Every wait has a timeout; a process that ignores SIGTERM is killed with its
process group, and a failing service aborts the run with its log tail.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from common.config import RlstreamConfig
from common.errors import RlstreamError

log = logging.getLogger("rlstream.demo")

# Held-out accuracy the demo tracks: mean accuracy over 8 samples per problem at
# the rollout temperature (the paper's "mean accuracy over k samples"); greedy
# accuracy is reported beside it.
DEFAULT_METRIC = "avg@8"
OUTCOMES = ("trained", "dropped_stale", "timed_out", "duplicate", "mismatch", "dlq")


def say(msg: str) -> None:
    """Progress for the person watching (stdout, flushed); logs go to stderr."""
    print(msg, flush=True)


def _opt(cfg: RlstreamConfig, name: str, default):
    """A `demo.*` setting, or its default while DemoSettings does not declare it."""
    return getattr(cfg.demo, name, default)


# ---------------------------------------------------------------------------- prepare

@dataclass
class Warm:
    model_dir: Path
    train_path: Path
    heldout_path: Path
    accuracy: float
    """Held-out accuracy under `metric` (what the demo's target is measured in)."""
    sft_seconds: float
    sft_steps: int
    reused: bool
    metric: str = "greedy"
    greedy_accuracy: float = 0.0


def prepare_warm(cfg: RlstreamConfig, reuse: bool | None = None) -> Warm:
    """Base model + task data (common/toy/build.py), then the SFT warm start under demo.work_dir."""
    from common.toy.build import ensure_data, ensure_model, heldout_path
    from common.harness.sft import SftConfig, warm_start

    base = ensure_model(cfg)
    train = ensure_data(cfg)
    heldout = heldout_path(cfg)
    sft_cfg = SftConfig(band_low=_opt(cfg, "sft_band_low", SftConfig.band_low),
                        band_high=_opt(cfg, "sft_band_high", SftConfig.band_high),
                        max_steps=_opt(cfg, "sft_max_steps", SftConfig.max_steps),
                        seed=cfg.producer.prompts.seed)
    reuse = _opt(cfg, "reuse_warm_start", True) if reuse is None else reuse
    out = Path(cfg.demo.work_dir) / "warm-model"
    t0 = time.monotonic()
    res = warm_start(base, out, train, heldout, sft_cfg, reuse=reuse, progress=say)
    if not res.in_band:
        say(f"warning: SFT ended at held-out accuracy {res.accuracy:.3f}, outside "
            f"[{sft_cfg.band_low}, {sft_cfg.band_high}] (step cap or a jump over the band)")
    metric = _opt(cfg, "eval_metric", DEFAULT_METRIC)
    scores = score_dir(out, heldout, metric, cfg.producer.temperature, cfg.producer.max_tokens)
    say(f"warm start: held-out {metric} accuracy {scores['accuracy']:.3f} (greedy {scores['greedy']:.3f}) "
        f"after {res.steps} SFT steps ({'reused' if res.reused else f'{time.monotonic() - t0:.0f} s'})")
    return Warm(out.resolve(), train.resolve(), heldout.resolve(), scores["accuracy"], res.seconds,
                res.steps, res.reused, metric, scores["greedy"])


def score_dir(model_dir, heldout, metric: str, temperature: float, max_new_tokens: int) -> dict:
    """`common.harness.evaluate.heldout_scores` of a model directory (seeded sampling)."""
    import torch

    from common.harness.evaluate import heldout_scores, load_model, load_problems

    threads = torch.get_num_threads()
    model, tok = load_model(model_dir)
    try:
        return heldout_scores(model, tok, load_problems(heldout), metric, temperature, max_new_tokens)
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------- processes

def _die_with_parent() -> None:  # in the child, between fork and exec
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Service:
    """One `rlstream <command>` child process in its own process group."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    url: str | None = None  # http://host:port of /metrics and /healthz
    proc: subprocess.Popen | None = None
    returncode: int | None = None

    def start(self) -> "Service":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int:
        """Exit code after SIGTERM; kills the whole process group after `timeout_s`."""
        if self.proc is None:
            return 0
        try:
            self.returncode = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) ignored SIGTERM for %.0f s: killing its process group",
                      self.name, self.proc.pid, timeout_s)
            self.kill()
            self.returncode = self.proc.wait(10)
        return self.returncode

    def kill(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"


def child_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every service: explicit thread counts, offline, unbuffered.

    RLSTREAM__* variables are removed: the run's config file is the single source.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM__")}
    env.update({
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1",
    })
    env.update(extra or {})
    return env


def _rlstream(command: str, config: Path, sets: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "common.app.cli", command, "-c", str(config)]
    for s in sets:
        argv += ["--set", s]
    return argv


# ---------------------------------------------------------------------------- run config

@dataclass
class RunDirs:
    root: Path

    @property
    def config(self) -> Path: return self.root / "config.yaml"
    @property
    def logs(self) -> Path: return self.root / "logs"
    @property
    def weights(self) -> Path: return self.root / "weights"
    @property
    def checkpoints(self) -> Path: return self.root / "checkpoints"
    @property
    def blobs(self) -> Path: return self.root / "blobs"
    @property
    def progress(self) -> Path: return self.root / "progress.jsonl"
    @property
    def report(self) -> Path: return self.root / "report"


def new_run_dir(work_dir: str | os.PathLike, label: str) -> RunDirs:
    """A fresh `<work_dir>/runs/<label>-<timestamp>` (never reuses state)."""
    root = Path(work_dir).resolve() / "runs" / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while root.exists():
        root = root.with_name(f"{root.name.split('.')[0]}.{n}")
        n += 1
    root.mkdir(parents=True)
    return RunDirs(root)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[last] = value


def write_run_config(cfg: RlstreamConfig, dirs: RunDirs, warm: Warm,
                     overrides: dict[str, Any] | None = None) -> RlstreamConfig:
    """The resolved config of one run: the warm model, fresh stores under the run dir."""
    data = cfg.model_dump(mode="json")
    for k, v in {"model.path": str(warm.model_dir), "model.build_tiny": False,
                 "producer.prompts.path": str(warm.train_path),
                 "consumer.weight_store_dir": str(dirs.weights),
                 "consumer.checkpoint_dir": str(dirs.checkpoints),
                 "kafka.blob_dir": str(dirs.blobs)}.items():
        _set_dotted(data, k, v)
    for k, v in (overrides or {}).items():
        _set_dotted(data, k, v)
    run_cfg = RlstreamConfig.model_validate(data)
    dirs.config.write_text(yaml.safe_dump(run_cfg.model_dump(mode="json"), sort_keys=False))
    os.chmod(dirs.config, 0o600)  # may hold SASL credentials of a real cluster
    return run_cfg


# ---------------------------------------------------------------------------- metrics

Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout_s: float = 3.0) -> Metrics | None:
    """Prometheus samples of `url`/metrics as {(name, labels): value}; None if unreachable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
    except OSError:
        return None
    out: Metrics = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(m: Metrics | None, metric_name: str, default: float = 0.0, **labels) -> float:
    """One sample of a scrape (labels as keywords); `default` when absent."""
    if not m:
        return default
    return m.get((metric_name, tuple(sorted(labels.items()))), default)


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


# ---------------------------------------------------------------------------- pipeline

class PipelineError(RlstreamError):
    """A service failed to start, died, or did not stop cleanly."""


@dataclass
class Pipeline:
    """Broker + producers + consumer as separate processes for one run directory."""

    cfg: RlstreamConfig
    dirs: RunDirs
    num_producers: int = 1
    start_timeout_s: float = 240.0
    stop_timeout_s: float = 120.0
    services: list[Service] = field(default_factory=list)
    bootstrap: str = ""

    @property
    def broker(self) -> Service: return self.services[0]
    @property
    def producers(self) -> list[Service]: return [s for s in self.services if s.name.startswith("producer")]
    @property
    def consumer(self) -> Service: return next(s for s in self.services if s.name == "consumer")

    def start(self) -> None:
        """Broker first (until it answers Kafka requests), then consumer and producers."""
        from common.kafka.broker import free_port, kafka_ping

        host, port = self.cfg.broker.host, free_port(self.cfg.broker.host)
        self.bootstrap = f"{host}:{port}"
        self._spawn("broker", [f"broker.port={port}"], threads=1)
        self._wait_for(lambda: kafka_ping(host, port, 0.5), "broker", 30.0)
        kafka = f"kafka.bootstrap_servers={self.bootstrap}"
        self._spawn("consumer", [kafka], threads=self.cfg.consumer.num_threads, http="consumer")
        ncpu = os.cpu_count() or 1
        for i in range(self.num_producers):
            self._spawn(f"producer-{i}", [kafka, f"producer.producer_id=p{i}",
                                          f"producer.prompts.seed={self.cfg.producer.prompts.seed + i}",
                                          f"producer.engine.seed={self.cfg.producer.engine.seed + i}"],
                        threads=self.cfg.producer.num_threads, http="producer",
                        extra_env={"VLLM_CPU_OMP_THREADS_BIND": str(i % ncpu)})
        for s in self.services[1:]:
            self._wait_for(lambda s=s: healthy(s.url), s.name, self.start_timeout_s)

    def _spawn(self, name: str, sets: list[str], threads: int, http: str | None = None,
               extra_env: dict | None = None) -> Service:
        """Start `rlstream <command>`; `http` names the section whose http.port gets a free port."""
        from common.kafka.broker import free_port

        url = None
        if http is not None:
            host = getattr(self.cfg, http).http.host
            port = free_port(host)
            sets = [*sets, f"{http}.http.port={port}"]
            url = f"http://{host}:{port}"
        command = name.split("-")[0]
        s = Service(name, _rlstream(command, self.dirs.config, sets), self.dirs.logs / f"{name}.log",
                    child_env(threads, extra_env), url=url)
        self.services.append(s.start())
        log.info("started %s (pid %d): %s", name, s.pid, " ".join(s.argv[2:]))
        return s

    def _wait_for(self, ready: Callable[[], bool], name: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            if ready():
                return
            time.sleep(0.5)
        raise PipelineError(f"{name} not ready within {timeout_s:.0f} s; log tail:\n"
                            + next(s for s in self.services if s.name == name).log_tail())

    def check_alive(self) -> None:
        for s in self.services:
            if s.proc is not None and s.proc.poll() is not None:
                raise PipelineError(f"{s.name} exited with code {s.proc.returncode}; log tail "
                                    f"({s.log_path}):\n{s.log_tail()}")

    def scrape_all(self) -> dict[str, Metrics | None]:
        return {s.name: scrape(s.url) for s in self.services if s.url}

    def stop(self, quiesce_timeout_s: float = 60.0) -> "Shutdown":
        """Producers (drain) -> consumer takes in the rest -> consumer -> broker."""
        for p in self.producers:
            p.terminate()
        codes = {p.name: p.wait(self.stop_timeout_s) for p in self.producers}
        published = self.topic_records() if self.services and self.broker.alive() else None
        final, waited = None, 0.0
        consumer = next((s for s in self.services if s.name == "consumer"), None)
        if consumer is not None:
            final, waited = self._quiesce(published, quiesce_timeout_s)
            consumer.terminate()
            codes["consumer"] = consumer.wait(self.stop_timeout_s)
        if self.services:
            self.broker.terminate()
            codes["broker"] = self.broker.wait(30.0)
        return Shutdown(codes, published, final, waited)

    def _quiesce(self, published: "TopicCensus | None", timeout_s: float) -> tuple[Metrics | None, float]:
        """Wait until the consumer read everything and its counters stop moving."""
        t0 = time.monotonic()
        last, stable_since = None, time.monotonic()
        while time.monotonic() - t0 < timeout_s and self.consumer.alive():
            m = scrape(self.consumer.url)
            counted = sum(metric(m, "rlstream_consumer_records_total", outcome=o) for o in OUTCOMES)
            done = (m is not None and metric(m, "rlstream_consumer_lag_records", 1) == 0
                    and metric(m, "rlstream_consumer_open_groups", 1) == 0)
            if counted != last:
                last, stable_since = counted, time.monotonic()
            if done and published is not None and time.monotonic() - stable_since > 3.0:
                return m, time.monotonic() - t0
            time.sleep(0.5)
        return scrape(self.consumer.url), time.monotonic() - t0

    def topic_records(self, timeout_s: float = 60.0) -> "TopicCensus | None":
        """Read the whole rollouts topic: records, distinct rollout ids, end offsets."""
        try:
            return topic_census(self.cfg.kafka.model_copy(update={"bootstrap_servers": self.bootstrap}),
                                timeout_s)
        except Exception as e:  # noqa: BLE001 - accounting reports it as unknown
            log.error("could not read the rollouts topic: %s", e)
            return None

    def kill_all(self) -> None:
        for s in self.services:
            if s.alive():
                s.kill()


@dataclass
class TopicCensus:
    end_offsets: int
    """Sum of the partitions' end offsets."""
    records: int
    """Records actually read from offset 0 to the end offsets."""
    distinct_ids: int
    """Distinct rollout ids among them (a producer retry could duplicate a record)."""


def topic_census(kafka, timeout_s: float = 60.0) -> TopicCensus:
    """Count what the producers published, independently of every service's counters."""
    import msgpack
    from kafka import TopicPartition

    from common.kafka.client import make_consumer

    c = make_consumer(kafka, fetch_max_bytes=kafka.max_message_bytes, max_partition_fetch_bytes=kafka.max_message_bytes)
    try:
        topic = kafka.topics.rollouts
        tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic) or [])]
        c.assign(tps)
        c.seek_to_beginning(*tps)
        ends = c.end_offsets(tps)
        ids, records = set(), 0
        deadline = time.monotonic() + timeout_s
        while any(c.position(tp) < ends[tp] for tp in tps) and time.monotonic() < deadline:
            for batch in c.poll(timeout_ms=500, max_records=10_000).values():
                for msg in batch:
                    records += 1
                    try:
                        ids.add(msgpack.unpackb(msg.value, raw=False).get("rollout_id"))
                    except Exception:  # noqa: BLE001 - undecodable: counted, not identified
                        ids.add(("undecodable", msg.partition, msg.offset))
        return TopicCensus(int(sum(ends.values())), records, len(ids))
    finally:
        c.close()


@dataclass
class Shutdown:
    exit_codes: dict[str, int]
    published: TopicCensus | None
    consumer_metrics: Metrics | None
    quiesce_seconds: float


# ---------------------------------------------------------------------------- accounting

def account(census: TopicCensus | None, m: Metrics | None, group_size: int, groups_per_batch: int) -> dict:
    """published == trained + dropped_stale + timed_out + duplicate + mismatch + dlq + held.

    `held` are records of complete groups waiting for a full batch when the
    consumer stopped (fewer than B groups); the checkpoint keeps their offsets,
    so a restarted consumer trains them. With the consumer's
    `rlstream_consumer_held_records` gauge the equation is checked exactly;
    without it, held is the remainder and must be whole groups, fewer than B.
    """
    out = {o: int(metric(m, "rlstream_consumer_records_total", outcome=o)) for o in OUTCOMES}
    published = census.records if census else None
    out["published"] = published
    if census is not None:
        out["topic_end_offsets"], out["distinct_ids"] = census.end_offsets, census.distinct_ids
    counted = sum(out[o] for o in OUTCOMES)
    gauge = metric(m, "rlstream_consumer_held_records", default=float("nan"))
    if published is None or m is None:
        out.update(held=None, ok=False, why="published count or consumer metrics unavailable")
        return out
    if gauge == gauge:  # not NaN: the consumer reports what it holds
        out["held"] = int(gauge)
        out["ok"] = published == counted + int(gauge)
        out["why"] = "exact (held gauge)"
    else:
        held = published - counted
        out["held"] = held
        out["ok"] = 0 <= held < group_size * groups_per_batch and held % group_size == 0
        out["why"] = f"held = remainder, must be whole groups < B*G = {group_size * groups_per_batch}"
    return out


# ---------------------------------------------------------------------------- watching

@dataclass
class Observer:
    """Turns successive scrapes into progress rows (interval rates, last-step values)."""

    t0: float = field(default_factory=time.monotonic)
    prev: dict = field(default_factory=dict)

    def row(self, scrapes: dict[str, Metrics | None]) -> dict:
        now = time.monotonic()
        prods = [m for n, m in scrapes.items() if n.startswith("producer") and m]
        c = scrapes.get("consumer")
        cur = {
            "t": now,
            "samples": sum(metric(m, "rlstream_producer_samples_total") for m in prods),
            "reward_sum": sum(metric(m, "rlstream_producer_reward_sum") for m in prods),
            "trained": metric(c, "rlstream_consumer_records_total", outcome="trained"),
            "st_sum": metric(c, "rlstream_consumer_staleness_versions_sum"),
            "st_n": metric(c, "rlstream_consumer_staleness_versions_count"),
        }
        p = self.prev or {**cur, "t": self.t0, "samples": 0, "reward_sum": 0, "trained": 0, "st_sum": 0, "st_n": 0}
        dt = max(cur["t"] - p["t"], 1e-6)
        d = {k: cur[k] - p[k] for k in cur}
        self.prev = cur
        step = lambda name: metric(c, "rlstream_trainer_step_metric", float("nan"), name=name)  # noqa: E731
        return {
            "kind": "tick", "time": round(now - self.t0, 2),
            "version": int(metric(c, "rlstream_consumer_policy_version")),
            "reward_mean": d["reward_sum"] / d["samples"] if d["samples"] else None,
            "kl": _num(step("kl_train_inference")), "entropy": _num(step("entropy")),
            "clip_frac": _num(step("clip_frac")), "is_truncated_frac": _num(step("is_truncated_frac")),
            "staleness_mean": d["st_sum"] / d["st_n"] if d["st_n"] else None,
            "samples_per_s": d["trained"] / dt, "generated_per_s": d["samples"] / dt,
            "generated": int(d["samples"]),
            "producer_versions": [int(metric(m, "rlstream_producer_policy_version")) for m in prods],
            "outcomes": {o: int(metric(c, "rlstream_consumer_records_total", outcome=o)) for o in OUTCOMES},
            "lag": int(metric(c, "rlstream_consumer_lag_records")),
            "cum": _cumulative(c, prods),
        }


def _cumulative(c: Metrics | None, prods: list[Metrics]) -> dict:
    """Cumulative timing counters (differences over an interval give per-phase means).

    Consumer: seconds and count of each global-step phase (wait/train/checkpoint/
    publish); producers: weight-reload seconds and count, generated tokens, engine
    tokens per engine-second (so tokens / rate = seconds the engine was stepping),
    and admission refusals by reason.
    """
    out = {}
    for ph in ("wait", "train", "checkpoint", "publish"):
        out[f"c_{ph}_s"] = metric(c, "rlstream_consumer_step_phase_seconds_sum", phase=ph)
        out[f"c_{ph}_n"] = metric(c, "rlstream_consumer_step_phase_seconds_count", phase=ph)
    out["p_reload_s"] = sum(metric(m, "rlstream_producer_weight_reload_seconds_sum") for m in prods)
    out["p_reload_n"] = sum(metric(m, "rlstream_producer_weight_reload_seconds_count") for m in prods)
    out["p_tokens"] = sum(metric(m, "rlstream_producer_tokens_total") for m in prods)
    out["p_engine_s"] = sum(metric(m, "rlstream_producer_tokens_total") / metric(m, "rlstream_producer_tokens_per_second")
                            for m in prods if metric(m, "rlstream_producer_tokens_per_second") > 0)
    for reason in ("staleness", "publish_buffer", "paused"):
        out[f"p_held_{reason}"] = sum(metric(m, "rlstream_producer_held_back_total", reason=reason) for m in prods)
    return out


def _num(x: float) -> float | None:
    return None if x != x else x  # NaN -> None (JSON)


class VersionEvaluator:
    """Held-out accuracy of the newest weight version (greedy; pruned versions are skipped)."""

    def __init__(self, store_dir: Path, heldout: Path, metric: str = DEFAULT_METRIC,
                 temperature: float = 1.0, max_new_tokens: int = 8, limit: int | None = None):
        from common.harness.evaluate import load_problems

        self.store_dir = store_dir
        self.problems = load_problems(heldout, limit)
        self.metric, self.temperature, self.max_new_tokens = metric, temperature, max_new_tokens
        self.last_version = -1
        self.last_at = 0.0

    def due(self, min_interval_s: float) -> bool:
        return time.monotonic() - self.last_at >= min_interval_s

    def evaluate_newest(self) -> tuple[int, dict] | None:
        """(version, scores) of the newest version not evaluated yet, else None."""
        from common.harness.evaluate import heldout_scores, load_model
        from common.weights.store import WeightStore

        versions = WeightStore(self.store_dir, keep=1 << 30).versions()
        if not versions or versions[-1] == self.last_version:
            return None
        v = versions[-1]
        try:
            model, tok = load_model(WeightStore(self.store_dir, keep=1 << 30).path(v))
        except Exception as e:  # noqa: BLE001 - pruned while loading: try the next one later
            log.info("version %d vanished while loading (%s); skipping", v, e)
            return None
        self.last_version, self.last_at = v, time.monotonic()
        return v, heldout_scores(model, tok, self.problems, self.metric, self.temperature, self.max_new_tokens)


# ---------------------------------------------------------------------------- one RL run

@dataclass
class StopRule:
    """When a run ends (whichever comes first)."""

    target_accuracy: float | None = None
    confirmations: int = 2
    """Consecutive evaluations at or above the target."""
    max_seconds: float = 600.0
    max_versions: int | None = None


@dataclass
class RunResult:
    label: str
    run_dir: str
    warm_accuracy: float
    final_accuracy: float | None
    best_accuracy: float | None
    reached_target: bool
    seconds_to_target: float | None
    rl_seconds: float
    startup_seconds: float
    versions: int
    samples_per_s: float
    exit_codes: dict[str, int]
    accounting: dict
    error: str | None = None
    rows: list[dict] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return (self.error is None and all(c == 0 for c in self.exit_codes.values())
                and bool(self.accounting.get("ok")))

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "rows"}


def _progress_line(row: dict, acc: tuple[int, float] | None, warm: float) -> str:
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    acc_s = "-" if acc is None else f"{acc[1]['accuracy']:.3f}@v{acc[0]}"
    o = row["outcomes"]
    return (f"[{int(row['time']) // 60:2d}:{int(row['time']) % 60:02d}] v={row['version']:<4d} "
            f"reward={f(row['reward_mean'], '.3f')} heldout={acc_s} (warm {warm:.3f}) "
            f"kl={f(row['kl'], '.2e')} stale={f(row['staleness_mean'], '.2f')} "
            f"samples/s={row['samples_per_s']:.1f} trained={o['trained']} "
            f"dropped={o['dropped_stale']} timed_out={o['timed_out']} dlq={o['dlq']}")


def run_rl(cfg: RlstreamConfig, warm: Warm, label: str, stop: StopRule,
           overrides: dict[str, Any] | None = None, tick_s: float = 5.0,
           eval_every_s: float = 15.0, num_producers: int | None = None) -> RunResult:
    """One run: fresh run dir, start the services, watch until `stop`, shut down, account."""
    import torch

    torch.set_num_threads(1)  # the services own the cores; evaluation is small
    dirs = new_run_dir(cfg.demo.work_dir, label)
    run_cfg = write_run_config(cfg, dirs, warm, overrides)
    pipe = Pipeline(run_cfg, dirs, num_producers or cfg.demo.num_producers)
    evaluator = VersionEvaluator(dirs.weights, warm.heldout_path, warm.metric, run_cfg.producer.temperature,
                                 run_cfg.producer.max_tokens)
    # the warm start is version 0 (the consumer publishes it unchanged as v0)
    rows: list[dict] = [{"kind": "eval", "time": 0.0, "version": 0, "heldout_accuracy": warm.accuracy,
                         "heldout_greedy": warm.greedy_accuracy, "metric": warm.metric, "source": "warm start"}]
    t_start = time.monotonic()
    res = RunResult(label, str(dirs.root), warm.accuracy, None, None, False, None, 0.0, 0.0, 0, 0.0, {}, {})
    say(f"== run {label}: {dirs.root} (logs in {dirs.logs})")
    try:
        pipe.start()
        res.startup_seconds = time.monotonic() - t_start
        say(f"services up in {res.startup_seconds:.0f} s: broker {pipe.bootstrap}, "
            + ", ".join(f"{s.name} {s.url}" for s in pipe.services[1:]))
        _watch(pipe, evaluator, stop, rows, res, tick_s, eval_every_s)
    except (PipelineError, KeyboardInterrupt) as e:
        res.error = "interrupted" if isinstance(e, KeyboardInterrupt) else str(e)
        say(f"run {label} failed: {res.error}")
    finally:
        _shutdown(pipe, run_cfg, res)
        _final_eval(evaluator, rows, res, t_start)
        with open(dirs.progress, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        res.rows = rows
        (dirs.root / "summary.json").write_text(json.dumps(res.summary(), indent=1))
    return res


def _watch(pipe: Pipeline, evaluator: VersionEvaluator, stop: StopRule, rows: list[dict],
           res: RunResult, tick_s: float, eval_every_s: float) -> None:
    obs = Observer()
    hits, acc = 0, None
    while True:
        time.sleep(tick_s)
        pipe.check_alive()
        row = obs.row(pipe.scrape_all())
        rows.append(row)
        if evaluator.due(eval_every_s) and (r := evaluator.evaluate_newest()) is not None:
            acc = r
            rows.append(_eval_row(time.monotonic() - obs.t0, *r))
            res.best_accuracy = max(res.best_accuracy or 0.0, r[1]["accuracy"])
            hit = stop.target_accuracy is not None and r[1]["accuracy"] >= stop.target_accuracy
            hits = hits + 1 if hit else 0
            if hit and res.seconds_to_target is None and hits >= stop.confirmations:
                res.seconds_to_target = rows[-1]["time"]
        say(_progress_line(row, acc, res.warm_accuracy))
        res.versions = row["version"]
        res.rl_seconds = row["time"]
        if stop.target_accuracy is not None and hits >= stop.confirmations:
            res.reached_target = True
            say(f"target reached: held-out accuracy {acc[1]['accuracy']:.3f} >= {stop.target_accuracy:.3f} "
                f"on {hits} evaluations in a row")
            return
        if row["time"] >= stop.max_seconds or (stop.max_versions and row["version"] >= stop.max_versions):
            say(f"stopping at version {row['version']} after {row['time']:.0f} s (limit)")
            return


def _shutdown(pipe: Pipeline, run_cfg: RlstreamConfig, res: RunResult) -> None:
    say("stopping: producers drain, consumer takes in the rest, then the broker")
    try:
        sd = pipe.stop()
        res.exit_codes = sd.exit_codes
        res.accounting = account(sd.published, sd.consumer_metrics, run_cfg.consumer.group_size,
                                 run_cfg.consumer.groups_per_batch)
        trained = res.accounting.get("trained") or 0
        res.samples_per_s = trained / res.rl_seconds if res.rl_seconds else 0.0
    except Exception as e:  # noqa: BLE001 - never leave processes behind
        res.error = res.error or f"shutdown failed: {e}"
        log.exception("shutdown failed")
    finally:
        pipe.kill_all()
    say(f"exit codes {res.exit_codes}; accounting {res.accounting}")


def _eval_row(t: float, version: int, scores: dict) -> dict:
    return {"kind": "eval", "time": round(t, 2), "version": version, "heldout_accuracy": scores["accuracy"],
            "heldout_greedy": scores["greedy"], "heldout_pass_at_k": scores.get("pass"),
            "metric": scores["metric"], "eval_seconds": round(scores["seconds"], 2)}


def _final_eval(evaluator: VersionEvaluator, rows: list[dict], res: RunResult, t_start: float) -> None:
    try:
        r = evaluator.evaluate_newest()
    except Exception as e:  # noqa: BLE001
        log.error("final evaluation failed: %s", e)
        r = None
    if r is not None:
        rows.append(_eval_row(res.rl_seconds, *r))
        res.best_accuracy = max(res.best_accuracy or 0.0, r[1]["accuracy"])
    evals = [x for x in rows if x["kind"] == "eval"]
    res.final_accuracy = evals[-1]["heldout_accuracy"] if evals else None


# ---------------------------------------------------------------------------- main

def main(cfg: RlstreamConfig) -> int:
    from common.harness.report import write_report

    t0 = time.monotonic()
    budget = cfg.demo.max_minutes * 60
    say(f"rlstream demo: budget {cfg.demo.max_minutes:g} min, target +{cfg.demo.target_gain:.2f} "
        f"held-out accuracy over the warm start, {cfg.demo.num_producers} producer(s)")
    warm = prepare_warm(cfg)
    target = min(1.0, warm.accuracy + cfg.demo.target_gain)
    # leave time for engine start (~40 s), shutdown and the report within the budget
    rl_budget = max(60.0, budget - (time.monotonic() - t0) - 120.0)
    stop = StopRule(target_accuracy=target, max_seconds=rl_budget)
    res = run_rl(cfg, warm, "demo", stop, tick_s=_opt(cfg, "progress_every_s", 5.0),
                 eval_every_s=_opt(cfg, "eval_every_s", 15.0))
    wall = time.monotonic() - t0
    out = write_report(Path(res.run_dir) / "progress.jsonl", Path(res.run_dir) / "report",
                       {**res.summary(), "metric": warm.metric, "warm_greedy_accuracy": warm.greedy_accuracy,
                        "target_accuracy": target, "sft_seconds": warm.sft_seconds,
                        "sft_steps": warm.sft_steps, "sft_reused": warm.reused, "demo_wall_seconds": wall})
    say(f"report: {out}")
    say(f"demo {'succeeded' if res.ok and res.reached_target else 'FAILED'}: held-out accuracy "
        f"{warm.accuracy:.3f} -> {res.final_accuracy if res.final_accuracy is not None else float('nan'):.3f} "
        f"(best {res.best_accuracy or 0:.3f}, target {target:.3f}) in {wall / 60:.1f} min")
    return 0 if res.ok and res.reached_target else 1
