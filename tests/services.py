"""Real rlstream services as subprocesses, for fault-injection and soak runs.

`Service` starts `python -m producer|consumer -c <yaml>` in its own process
group (so a SIGKILL reaches every child, e.g. vLLM workers), with stdout and
stderr in one log file per incarnation, and finds the HTTP address the
service logs at start-up. `scrape()` / `metric()` read /metrics with
prometheus_client's parser. Every wait has a timeout and notices a service
that died while it was being waited for.

Also here: config builders for the tiny model, `SyntheticFeeder` (a thread
that publishes synthetic groups and remembers what it published), and
readers for the audit log (`<checkpoint_dir>/trained.jsonl`), the DLQ and
the rollouts topic.
"""
from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from common.config import KafkaSettings, RlstreamConfig

ADMIN_TOKEN = "rlstream-test-token-7f3a"
_HTTP_RE = re.compile(r"http: serving .* on (http://[0-9.]+:\d+)")
_STEP_RE = re.compile(r"step=(\d+) version=(\d+) .* (trained=\d+ .*)$")
_OUTCOMES_RE = re.compile(r"consumer stopped at step (\d+), version (\d+); outcomes (\{.*\})")


# --------------------------------------------------------------- configs

def service_config(kafka: KafkaSettings, model_dir, tmp: Path, *, G: int = 4, B: int = 2,
                   staleness: dict | None = None, consumer: dict | None = None,
                   producer: dict | None = None) -> RlstreamConfig:
    """A small config for the tiny model: consumer and producer sections both set."""
    c = {"group_size": G, "groups_per_batch": B, "optimizer": {"lr": 1e-3}, "checkpoint_dir": str(tmp / "ckpt"),
         "weight_store_dir": str(tmp / "weights"), "group_timeout_s": 30.0,
         "http": {"port": 0, "admin_token": ADMIN_TOKEN}, **(consumer or {})}
    p = {"group_size": G, "max_tokens": 6, "prompts": {"type": "jsonl", "path": str(tmp / "data" / "train.jsonl")},
         "max_groups_in_flight": 8, "http": {"port": 0, "admin_token": ADMIN_TOKEN},
         "engine": {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 64}, **(producer or {})}
    return RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"path": str(model_dir), "build_tiny": False},
        "staleness": {"max_staleness": 1, "mode": "drop", **(staleness or {})},
        "producer": p, "consumer": c})


def write_config(cfg: RlstreamConfig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def ensure_prompts(cfg: RlstreamConfig, n_train: int = 64) -> None:
    from common.toy.build import ensure_data

    ensure_data(cfg, n_train=n_train, n_heldout=8)


# --------------------------------------------------------------- waiting

def wait_until(pred, timeout: float, what: str, services=(), interval: float = 0.2):
    """Poll `pred()` until truthy (returned); AssertionError on timeout or if a service died."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        for s in services:
            if not s.alive:
                raise AssertionError(f"{s.name} exited ({s.returncode}) while waiting for {what}; "
                                     f"log tail:\n{s.log_tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# --------------------------------------------------------------- services

class Service:
    """One service incarnation after another (`start()` again after a kill)."""

    def __init__(self, kind: str, config: Path, log_dir: Path, name: str | None = None,
                 env: dict | None = None):
        assert kind in ("producer", "consumer")
        self.kind, self.config, self.log_dir = kind, Path(config), Path(log_dir)
        self.name = name or kind
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "RLSTREAM_LOG_LEVEL": "INFO", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0
        self.log_path: Path | None = None
        self._url: str | None = None

    # lifecycle
    def start(self) -> "Service":
        assert not self.alive, f"{self.name} is already running"
        self.incarnation += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{self.name}.{self.incarnation}.log"
        self._url = None
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", self.kind, "-c", str(self.config)],
                                         env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self):
        return None if self.proc is None else self.proc.poll()

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 60) -> int | None:
        """Send `sig` to the whole process group; wait for the leader's exit."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(timeout=30)
        finally:
            if sig == signal.SIGKILL:
                self._reap_group()

    def _reap_group(self) -> None:
        try:  # children (vLLM workers) of a SIGKILLed leader
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout: float = 120) -> int | None:
        """SIGTERM (graceful: the service drains / finishes its step); SIGKILL after `timeout`."""
        return self.kill(signal.SIGTERM, timeout=timeout)

    # logs and http
    def log_text(self, incarnation: int | None = None) -> str:
        path = self.log_path if incarnation is None else self.log_dir / f"{self.name}.{incarnation}.log"
        try:
            return path.read_text(errors="replace")
        except (OSError, AttributeError):
            return ""

    def all_logs(self) -> str:
        return "".join(self.log_text(i) for i in range(1, self.incarnation + 1))

    def log_tail(self, n: int = 4000) -> str:
        return self.log_text()[-n:]

    @property
    def url(self) -> str | None:
        if self._url is None:
            m = _HTTP_RE.search(self.log_text())
            self._url = m.group(1) if m else None
        return self._url

    def wait_http(self, timeout: float = 240) -> str:
        return wait_until(lambda: self.url, timeout, f"{self.name} http endpoint", [self])

    def get(self, path: str, token: str | None = None, timeout: float = 10) -> tuple[int, bytes]:
        return http_request(self.url + path, token=token, timeout=timeout)

    def scrape(self) -> str:
        code, body = self.get("/metrics")
        assert code == 200, code
        return body.decode()

    def metric(self, name: str, **labels) -> float:
        return metric_value(self.scrape(), name, **labels)

    def try_metric(self, name: str, default: float = float("nan"), **labels) -> float:
        try:
            return self.metric(name, **labels) if self.url else default
        except (OSError, AssertionError):
            return default

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc) -> None:
        if self.alive:
            self.kill()


def http_request(url: str, method: str = "GET", body: dict | bytes | None = None,
                 token: str | None = None, headers: dict | None = None,
                 timeout: float = 10) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def metric_value(text: str, name: str, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 if none)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def rss_bytes(pid: int) -> int:
    """Resident set size of one process (Linux /proc), 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def group_rss_bytes(pgid: int) -> int:
    """Summed RSS of every process in a process group (a service and its workers)."""
    total = 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    total += rss_bytes(int(d.name))
            except (ProcessLookupError, PermissionError):
                continue
    return total


# --------------------------------------------------------------- consumer state from outside

def audit_steps(checkpoint_dir: Path) -> dict[int, list[str]]:
    """step -> trained rollout ids, from trained.jsonl (the last line per step is the committed one)."""
    path = Path(checkpoint_dir) / "trained.jsonl"
    steps: dict[int, list[str]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                e = json.loads(line)
                steps[e["step"]] = e["trained"]
    return steps


def audit_lines(checkpoint_dir: Path) -> int:
    path = Path(checkpoint_dir) / "trained.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def committed_checkpoint(checkpoint_dir: Path):
    """The newest complete checkpoint's CheckpointState, or None."""
    from consumer.checkpoint import CheckpointManager

    latest = CheckpointManager(checkpoint_dir).latest()
    return None if latest is None else latest[0]


def last_step_counters(log: str) -> dict[str, int] | None:
    """Outcome counters of the consumer's last per-step log line."""
    found = None
    for line in log.splitlines():
        m = _STEP_RE.search(line)
        if m:
            found = {k: int(v) for k, v in (kv.split("=") for kv in m.group(3).split())}
    return found


def final_outcomes(log: str) -> dict[str, float] | None:
    """Counters the consumer logged when it stopped cleanly (SIGTERM)."""
    m = None
    for m in _OUTCOMES_RE.finditer(log):
        pass
    return None if m is None else ast.literal_eval(m.group(3))


# --------------------------------------------------------------- topics

def read_topic(kafka: KafkaSettings, topic: str, quiet_s: float = 1.5, timeout_s: float = 60) -> list:
    """Every raw message of `topic` (all partitions), until `quiet_s` without new ones."""
    from kafka import KafkaConsumer, TopicPartition

    from common.kafka.client import client_kwargs

    c = KafkaConsumer(**client_kwargs(kafka), group_id=None, enable_auto_commit=False,
                      auto_offset_reset="earliest", max_partition_fetch_bytes=kafka.max_message_bytes + (1 << 20),
                      fetch_max_bytes=max(52_428_800, kafka.max_message_bytes + (1 << 20)))
    try:
        parts = c.partitions_for_topic(topic) or {0}
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        c.assign(tps)
        c.seek_to_beginning(*tps)
        out, last, deadline = [], time.monotonic(), time.monotonic() + timeout_s
        while time.monotonic() - last < quiet_s and time.monotonic() < deadline:
            for msgs in c.poll(timeout_ms=300, max_records=5000).values():
                out.extend(msgs)
                last = time.monotonic()
        return out
    finally:
        c.close()


@dataclass(frozen=True)
class DeadLetter:
    source: str  # topic/partition/offset of the original record
    field: str
    reason: str
    value: bytes


def read_dlq(kafka: KafkaSettings, **kw) -> list[DeadLetter]:
    from common.kafka.reader import H_FIELD, H_REASON, H_SOURCE

    out = []
    for m in read_topic(kafka, kafka.topics.dlq, **kw):
        h = {k: v.decode("utf-8", "replace") for k, v in (m.headers or [])}
        out.append(DeadLetter(h.get(H_SOURCE, "?"), h.get(H_FIELD, "?"), h.get(H_REASON, "?"), m.value))
    return out


def read_rollouts(kafka: KafkaSettings, **kw) -> dict[str, object]:
    """rollout_id -> Rollout of every decodable record on the rollouts topic."""
    from common.record import Rollout, decode_any

    out = {}
    for m in read_topic(kafka, kafka.topics.rollouts, **kw):
        try:
            r = decode_any(m.value)
        except Exception:  # noqa: BLE001 - bad records are the DLQ's business
            continue
        if isinstance(r, Rollout):
            out[r.rollout_id] = r
    return out


def latest_policy(kafka: KafkaSettings):
    """The newest WeightsReady on the policy topic (None if none)."""
    from common.control.messages import WeightsReady, parse_policy_message

    best = None
    for m in read_topic(kafka, kafka.topics.policy, quiet_s=0.8):
        try:
            a = parse_policy_message(m.value)
        except Exception:  # noqa: BLE001
            continue
        if isinstance(a, WeightsReady) and (best is None or a.version > best.version):
            best = a
    return best


def send_raw(kafka: KafkaSettings, topic: str, key: bytes | None, value: bytes) -> None:
    """One message, acknowledged (acks=all), no validation at all."""
    from kafka import KafkaProducer

    from common.kafka.client import client_kwargs

    p = KafkaProducer(**client_kwargs(kafka), acks="all", max_request_size=kafka.max_message_bytes)
    try:
        p.send(topic, key=key, value=value).get(timeout=30)
    finally:
        p.close(timeout=10)


# --------------------------------------------------------------- synthetic producer

@dataclass
class Published:
    """What a SyntheticFeeder put on the topic (acknowledged by the broker)."""

    versions: dict[str, int] = field(default_factory=dict)  # rollout_id -> policy_version
    group_of: dict[str, str] = field(default_factory=dict)  # rollout_id -> group_id
    partial_groups: set[str] = field(default_factory=set)
    stale_groups: set[str] = field(default_factory=set)
    bad: int = 0

    @property
    def valid(self) -> int:
        return len(self.versions)


class SyntheticFeeder(threading.Thread):
    """Publishes synthetic groups (tests/synthetic.py) at about `rate_groups` per second.

    Each group is, by the configured fractions: complete and fresh (dispatch
    version = the newest announced version), complete and certainly stale
    (version 0, only once `stale_after` versions are committed), partial (G-1
    of G samples: a producer that died mid-group), or a raw invalid record.
    `hold()` pauses publishing (the consumer then waits in its fetch).
    """

    def __init__(self, kafka: KafkaSettings, G: int, *, seed: int = 0, rate_groups: float = 4.0,
                 p_partial: float = 0.1, p_stale: float = 0.15, p_bad: float = 0.05,
                 version_of=None, stale_after: int | None = None):
        super().__init__(name="synthetic-feeder", daemon=True)
        from common.kafka.publisher import RolloutPublisher

        self.kafka, self.G = kafka, G
        self.rng = np.random.default_rng(seed)
        self.rate, self.p_partial, self.p_stale, self.p_bad = rate_groups, p_partial, p_stale, p_bad
        self.version_of = version_of or (lambda: 0)
        self.stale_after = stale_after
        self.pub = RolloutPublisher(kafka)
        self.out = Published()
        self._stop_ev, self._go = threading.Event(), threading.Event()
        self._go.set()
        self._seq = 0
        self.error: BaseException | None = None

    def hold(self) -> None:
        self._go.clear()

    def go(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._stop_ev.set()
        self._go.set()
        self.join(60)
        self.pub.close()

    def run(self) -> None:
        try:
            while not self._stop_ev.is_set():
                self._go.wait()
                if self._stop_ev.is_set():
                    break
                self.publish_one()
                self._stop_ev.wait(1.0 / self.rate)
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            self.error = e

    def publish_one(self, kind: str | None = None) -> str:
        from synthetic import synthetic_group

        v_now = int(self.version_of())
        if kind is None:
            u = self.rng.random()
            stale_ok = self.stale_after is not None and v_now >= self.stale_after
            if u < self.p_bad:
                kind = "bad"
            elif u < self.p_bad + self.p_partial:
                kind = "partial"
            elif stale_ok and u < self.p_bad + self.p_partial + self.p_stale:
                kind = "stale"
            else:
                kind = "fresh"
        self._seq += 1
        gid = f"syn-{kind}-{self._seq}"
        if kind == "bad":
            self.pub.publish_bytes(gid.encode(), b"\x92\x01" + bytes(self.rng.integers(0, 256, 8, dtype=np.uint8)),
                                   timeout=60).result(timeout=60)
            self.out.bad += 1
            return kind
        group = synthetic_group(gid, self.G, 0 if kind == "stale" else v_now, self.rng)
        if kind == "partial":
            group = group[: self.G - 1]
            self.out.partial_groups.add(gid)
        if kind == "stale":
            self.out.stale_groups.add(gid)
        futs = [self.pub.publish(r, timeout=60) for r in group]
        for f in futs:
            f.result(timeout=60)
        for r in group:
            self.out.versions[r.rollout_id] = r.policy_version
            self.out.group_of[r.rollout_id] = gid
        return kind


def flush_half_batch(kafka: KafkaSettings, checkpoint_dir: Path, consumer: Service, G: int, B: int,
                     seed: int = 99, on_publish=None) -> None:
    """Publish fresh synthetic groups one at a time until a step takes one.

    After the consumer read everything, fewer than B kept groups may wait for
    their batch; a step that took a filler emptied that wait (each filler is
    fresh, so kept). `on_publish(rollouts)` sees every filler record.
    """
    from common.kafka.publisher import RolloutPublisher
    from synthetic import publish_groups, synthetic_group

    rng = np.random.default_rng(seed)
    with RolloutPublisher(kafka) as pub:
        for i in range(B):
            before = max(audit_steps(checkpoint_dir), default=0)
            fill = synthetic_group(f"filler-{seed}-{i}", G, before, rng)
            publish_groups(pub, [fill])
            if on_publish is not None:
                on_publish(fill)
            try:
                wait_until(lambda: max(audit_steps(checkpoint_dir), default=0) > before,
                           20 if i < B - 1 else 120, "a step taking the filler", [consumer])
                return
            except AssertionError:
                if i == B - 1:
                    raise
