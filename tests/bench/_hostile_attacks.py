"""The attacks of tests/bench/hostile.py: each hostile class, sent as an attacker would.

An attacker here holds a plain Kafka client with write access to the topics
(kafka-python, no admin token) and can open connections to every service's
HTTP port. Each method sends one round of its class and counts what it sent
in `Attacker.injected[class][kind]`; how each one is produced follows the test
that covers the class:

    journal_malformed   tests/integration/test_journal_hostile.py: a non-UTF-8 key, leases that
                        are not JSON or of the wrong shape, malformed entries, an entry under
                        another episode's key, and orphans (a holder that never had a lease)
                        whose record the schema refuses: a 4-million-token prompt, prompt ids
                        -5 and past the vocabulary, NaN log-probs, a 300-character rollout_id,
                        a sample past its group, routing of another model's shape
    journal_future      tests/unit/producer/test_journal_trust.py: a claim of a live episode
                        dated 100 s ahead, and a lease dated an hour ahead for a producer that
                        does not exist, holding a whole group of valid orphans (they must be
                        resumed once the lease is judged lapsed: lease_s + the skew bound)
    control_unsigned    tests/integration/test_control_authenticity.py: max_staleness 0, decay
                        0.5, paused true unsigned, one signed with another deployment's token,
                        one malformed; and a signed admin change copied and written again
                        after a newer one (replayed)
    weights_forged      the same file and tests/unit/producer/test_reload.py: WeightsReady
                        naming a durable copy outside the weight store (its digest matching its
                        bytes), a version a million ahead, a foreign (loopback) endpoint, a
                        TrainerProgress a million ahead, and one signed with another token
    rollouts_fuzz       tests/integration/test_fuzz_training.py: one record of each kind of its
                        generator, a few more drawn from it, and each kind of reused group id
                        (beside valid synthetic groups: valid traffic of the bench's own)
    http_slow           tests/integration/test_http_hostile.py: slow-header and slow-body
                        clients trickling one byte a second (past the head and body timeouts,
                        10 s and 30 s, when they trickle that long)
    http_over_cap       more connections at once than a service's cap (1024)
    http_malformed      JSON nested 60,000 deep, a head over the limit, a 100 MB body declared,
                        a wrong token

The broker freeze is the bench's own (SIGSTOP, SIGCONT: common/kafka/broker.py).
Not a bench (the leading underscore).
"""
from __future__ import annotations

import dataclasses
import json
import math
import socket
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

TRICKLE_HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: "
OVER_CAP = 1024 + 16
"""Connections opened at once against one service (its cap: common/http_server.py HttpLimits)."""


def _port(url: str) -> int:
    return urlsplit(url).port


class Attacker:
    """The hostile classes against one deployment (kafka topics, admin token, service URLs)."""

    def __init__(self, kafka, G: int, model_dir: Path, work: Path, *, journaling: bool, lease_s: float,
                 live_fuzz, admin_url, seed: int = 0):
        from kafka import KafkaProducer

        from rlstream.common.kafka.client import client_kwargs

        self.kafka, self.G, self.work, self.lease_s = kafka, G, work, lease_s
        self.vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        self.raw = KafkaProducer(**client_kwargs(kafka), acks="all", max_request_size=kafka.max_message_bytes)
        self.live = live_fuzz  # tests/integration/test_fuzz_training.py Live: its expected DLQ sources
        self.admin_url = admin_url  # () -> the consumer's URL (the admin API the bench's "operator" uses)
        self.injected: dict[str, Counter] = defaultdict(Counter)
        self.ghosts: dict[str, int] = {}  # ghost group id -> wall time its future-dated lease was written
        self.forged_claims: list[str] = []  # episode keys a forged claim named
        self.journal = None
        if journaling:
            from rlstream.producer.journal.topic import JournalTopic

            self.journal = JournalTopic(kafka, lease_s)  # the attacker reads the journal too
        self.rng = np.random.default_rng(seed)
        self._threads: list[threading.Thread] = []

    def close(self) -> None:
        for t in self._threads:
            t.join(60)
        self.raw.close(timeout=10)
        self.live.pub.close()
        if self.journal is not None:
            self.journal.close()

    def _send(self, topic: str, key: bytes | None, value: bytes | None, headers=()) -> None:
        self.raw.send(topic, key=key, value=value, headers=list(headers)).get(timeout=60)

    # ------------------------------------------------------------------ journal

    def _journal_sample(self):
        """A live producer's current entry (Held, Snapshot) or None: the attacker's template."""
        from rlstream.producer.journal.snapshot import decode

        self.journal.sync()
        live = [(k, e) for k, e in self.journal.entries.items()
                if (lease := self.journal.leases.get(e.holder)) is not None and lease.incarnation == e.incarnation
                and not e.holder.startswith("ghost-")]
        if not live:
            return None
        key, held = max(live, key=lambda kv: kv[1].written_at)
        return held, decode(self.journal.snapshots[key])

    def _orphan(self, group_id: str, i: int, holder: str, prompt: np.ndarray, written_at: float, **kw):
        from rlstream.producer.journal.snapshot import Snapshot

        base = dict(group_id=group_id, sample_idx=i, group_size=self.G, owner=holder, holder=holder,
                    incarnation="gone", rollout_id=uuid.uuid4().hex, written_at=written_at, prompt_text="1+2=",
                    answer="3", own_score=False, prompt_ids=prompt, response=np.zeros(0, np.int32),
                    mask=np.zeros(0, bool), logprobs=np.zeros(0, np.float32), versions=np.zeros(0, np.int64),
                    routing=None, num_experts=0, turns=0, reward=0.0)
        return Snapshot(**{**base, **kw})

    def journal_malformed(self, n: int, huge: bool = True) -> None:
        """Records every journaling producer must refuse, count and skip (never crash on)."""
        from rlstream.toy.tinymodel import TinyModelSpec
        from rlstream.producer.journal.snapshot import encode

        if self.journal is None:
            return
        topic, c = self.journal.topic, self.injected["journal_malformed"]
        sample = self._journal_sample()
        prompt = sample[1].prompt_ids if sample else np.arange(5, 10, dtype=np.int32)
        old = time.time() - 3600  # no lease ever: orphaned at once
        one = dict(response=np.array([5], np.int32), mask=np.ones(1, bool), versions=np.zeros(1, np.int64), turns=1)
        spec = TinyModelSpec()
        bad = {
            "prompt id -5": dict(prompt_ids=np.r_[prompt, -5].astype(np.int32)),
            "prompt id past the vocabulary": dict(prompt_ids=np.r_[prompt, self.vocab].astype(np.int32)),
            "NaN log-probs": dict(logprobs=np.array([math.nan], np.float32), **one),
            "300-character rollout_id": dict(rollout_id="r" * 300),
            "sample past its group": dict(sample_idx=self.G),
            "routing of another model": dict(routing=np.zeros((len(prompt), spec.num_hidden_layers + 1, 2), np.uint8),
                                             num_experts=4, logprobs=np.zeros(1, np.float32), **one),
        }
        if huge:
            bad["4M-token prompt"] = dict(prompt_ids=np.ones(4_000_000, np.int32))
        for i, (kind, change) in enumerate(bad.items()):
            s = self._orphan(f"hostile-{n}-{i}", 0, f"dead-{n}", prompt, old)
            s = dataclasses.replace(s, **change)
            self._send(topic, s.key.encode(), encode(s))
            c["limits: " + kind] += 1
        valid = self._orphan(f"hostile-{n}-k", 0, f"dead-{n}", prompt, old)
        for kind, key, value in (
                ("key not UTF-8", b"\xff\xfe" + str(n).encode(), b"x"),
                ("lease not JSON", f"lease:junk-{n}-a".encode(), b"not json"),
                ("lease not an object", f"lease:junk-{n}-b".encode(), b"[1, 2]"),
                ("lease time not a number", f"lease:junk-{n}-c".encode(), b'{"incarnation": "i", "at": "soon"}'),
                ("entry not an entry", f"ep:hostile-{n}-j#0".encode(), b"junk"),
                ("entry header malformed", f"ep:hostile-{n}-j#1".encode(), b"RJ1\x02\x00\x00\x00{}"),
                ("entry under another key", f"ep:hostile-{n}-k#12".encode(),
                 encode(dataclasses.replace(valid, sample_idx=1)))):
            self._send(topic, key, value)
            c[kind] += 1

    def journal_future(self, n: int) -> None:
        """A claim of a live episode dated 100 s ahead; a lease an hour ahead holding valid orphans."""
        from rlstream.producer.journal.snapshot import encode

        if self.journal is None:
            return
        topic, c = self.journal.topic, self.injected["journal_future"]
        sample = None
        for _ in range(20):  # an episode between two turns (entries live for a turn or two)
            if (sample := self._journal_sample()) is not None:
                break
            time.sleep(0.1)
        if sample is not None:
            held, s = sample
            forged = dataclasses.replace(s, holder=f"thief-{n}", incarnation="t", written_at=time.time() + 100,
                                         claimed_from=held.token, epoch=held.epoch + 1)
            self._send(topic, s.key.encode(), encode(forged))
            self.forged_claims.append(s.key)
            c["claim dated +100 s of a live episode"] += 1
        else:
            c["claim skipped: no live episode seen"] += 1
        ghost, now = f"ghost-{n}", time.time()
        self._send(topic, f"lease:{ghost}".encode(), json.dumps({"incarnation": "gone", "at": now + 3600}).encode())
        prompt = s.prompt_ids if sample else np.arange(5, 10, dtype=np.int32)
        for i in range(self.G):  # a whole group: resumed, it is a complete, valid group
            o = self._orphan(ghost, i, ghost, prompt, now, prompt_text=s.prompt_text if sample else "1+2=",
                             answer=s.answer if sample else "3")
            self._send(topic, o.key.encode(), encode(o))
        self.ghosts[ghost] = now
        c["lease dated +1 h holding a group of orphans"] += 1

    # ------------------------------------------------------------------ control and policy

    def control_unsigned(self, n: int) -> None:
        """Changes without the token's signature; an admin change replayed after a newer one."""
        from rlstream.common.control.messages import encode_control
        from rlstream.common.control.signing import HEADER, signature, signing_key

        topic, c = self.kafka.topics.control, self.injected["control_unsigned"]
        for key, value in (("max_staleness", 0), ("decay", 0.5), ("paused", True)):
            self._send(topic, *encode_control(key, value, by="hostile"))
            c[f"unsigned {key}"] += 1
        k, v = encode_control("paused", True, by="hostile")
        self._send(topic, k, v, [(HEADER, signature(signing_key("another-deployment"), k, v))])
        c["signed with another token"] += 1
        self._send(topic, b"max_staleness", b"not json")
        c["malformed"] += 1
        if self._replay():
            c["signed admin change replayed"] += 1

    def _replay(self) -> bool:
        """The operator sets max_staleness 3 then back to the configured 2 (the admin API, signed);
        the attacker copies the signed `3` and writes it again."""
        from rlstream.harness.census import read_topic
        from rlstream.harness.observe import http_request
        from tests.support.configs import ADMIN_TOKEN

        url = self.admin_url()
        for value in (3, 2):
            code, _ = http_request(url + "/admin/control", "POST", {"key": "max_staleness", "value": value},
                                   token=ADMIN_TOKEN, timeout=60)
            if code != 200:
                return False
        old = [m for m in read_topic(self.kafka, self.kafka.topics.control, to_end=True, timeout_s=30)
               if m.key == b"max_staleness" and m.headers and json.loads(m.value).get("value") == 3]
        if not old:
            return False
        self._send(self.kafka.topics.control, old[-1].key, old[-1].value, old[-1].headers)
        return True

    def weights_forged(self, n: int, trainer_version: int) -> None:
        """Announcements no trainer made, written to the policy topic by a plain client."""
        from rlstream.common.control.messages import TrainerProgress, WeightsReady
        from rlstream.common.control.signing import HEADER, signature, signing_key
        from rlstream.common.weights.store import WEIGHTS_FILE, sha256_file

        topic, c = self.kafka.topics.policy, self.injected["weights_forged"]
        evil = self.work / "elsewhere" / f"v{n}"
        evil.mkdir(parents=True, exist_ok=True)
        (evil / WEIGHTS_FILE).write_bytes(b"forged weights %d" % n)
        f = evil / WEIGHTS_FILE
        with socket.socket() as s:  # a loopback port nobody serves: the foreign endpoint
            s.bind(("127.0.0.1", 0))
            dead = s.getsockname()[1]
        forged = {
            "durable copy outside the store": WeightsReady(version=trainer_version + 1, transport="file",
                                                           uri=evil.as_uri(), sha256=sha256_file(f),
                                                           bytes=f.stat().st_size),
            "version a million ahead": WeightsReady(version=trainer_version + 1_000_000, transport="file",
                                                    uri=(self.work / "nowhere").as_uri(), sha256="0" * 64, bytes=1),
            "foreign endpoint": WeightsReady(version=trainer_version + 1, transport="collective", digest="f" * 64,
                                             endpoint=f"127.0.0.1:{dead}", backend="rlstream_gloo"),
            "trainer progress a million ahead": TrainerProgress(trainer_version=trainer_version + 1_000_000,
                                                                groups_per_batch=2, group_size=self.G),
        }
        for kind, msg in forged.items():
            self._send(topic, msg.kind.encode(), msg.model_dump_json().encode())
            c[kind] += 1
        msg = forged["version a million ahead"]
        k, v = msg.kind.encode(), msg.model_dump_json().encode()
        self._send(topic, k, v, [(HEADER, signature(signing_key("another-deployment"), k, v))])
        c["signed with another token"] += 1

    # ------------------------------------------------------------------ rollouts

    def rollouts_fuzz(self, n: int, trainer_version: int, extra: int = 3) -> None:
        """One bad record of each kind and `extra` drawn from the fuzz generator; each kind of
        reused group id; valid synthetic groups between them. A version from the future is
        the trainer's + 10**6 (the generator's >= 1000 is the past once the trainer is there)."""
        from tests.support.fuzz_records import KINDS, REUSES, pack

        c = self.injected["rollouts_fuzz"]
        for kind, field, value in [*(draw_bad((k,), n)[0] for k in KINDS), *draw_bad(None, n, extra)]:
            if kind == "future_version":
                value = pack(policy_version=trainer_version + 1_000_000)
            self.live.publish_bad(kind, field, value)
            c[kind] += 1
        for how in REUSES:
            sent = len(self.live.expected)
            self.live.publish_valid_group((how, [0, self.G - 1]))
            c[f"reused group id ({how})"] += len(self.live.expected) - sent
        self.live.publish_valid_group()

    # ------------------------------------------------------------------ http

    def http_slow(self, urls: dict[str, str], clients: int, seconds: float) -> None:
        """`clients` slow-header and clients // 7 slow-body connections per service, trickling
        one byte a second for `seconds` (past the 10 s head timeout), in the background."""
        from tests.support.http_clients import Trickler
        from tests.support.configs import ADMIN_TOKEN

        body_head = (b"POST /admin/control HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ADMIN_TOKEN.encode()
                     + b"\r\nContent-Length: 1000\r\n\r\n")
        c = self.injected["http_slow"]
        for name, url in urls.items():
            for what, n, head, tail in (("slow header", clients, TRICKLE_HEAD, b"abcdefgh"),
                                        ("slow body", max(1, clients // 7), body_head, b'{"key": "max_staleness", ')):
                t = Trickler(_port(url), n, head, tail, seconds)
                th = threading.Thread(target=lambda t=t: (t.run(), t.close()), daemon=True, name=f"trickle-{name}")
                th.start()
                self._threads.append(th)
                c[what] += n

    def http_over_cap(self, url: str) -> None:
        """OVER_CAP connections at once to one service; held until the last got its answer."""
        from tests.support.http_clients import flood_connections

        c = self.injected["http_over_cap"]
        answers = flood_connections(_port(url), OVER_CAP, b"", timeout=3.0)  # nothing sent: held until the timeout
        c["connections"] += OVER_CAP
        c["answered 503 at accept"] += sum(a.startswith(b"HTTP/1.1 503") for a in answers)

    def http_malformed(self, url: str) -> None:
        from tests.support.http_clients import exchange
        from tests.support.configs import ADMIN_TOKEN

        port, c = _port(url), self.injected["http_malformed"]
        auth = b"Authorization: Bearer " + ADMIN_TOKEN.encode() + b"\r\n"
        deep = b"[" * 60_000
        for kind, data in (
                ("JSON 60,000 deep", b"POST /admin/control HTTP/1.1\r\nHost: x\r\n" + auth
                 + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(deep) + deep),
                ("head over the limit", b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (20 << 10) + b"\r\n\r\n"),
                ("100 MB body declared", b"POST /admin/control HTTP/1.1\r\nHost: x\r\n" + auth
                 + b"Content-Length: %d\r\n\r\n" % (100 << 20) + b"x" * 4096),
                ("wrong token", b"POST /admin/control HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
                 b"Connection: close\r\nContent-Length: 2\r\n\r\n{}")):
            out, _ = exchange(port, data, timeout=10)
            c[kind] += 1
            c[f"{kind}: answered {out[9:12].decode(errors='replace') or 'nothing'}"] += 1


def draw_bad(kinds: tuple[str, ...] | None, seed: int, n: int = 1) -> list[tuple[str, str, bytes]]:
    """`n` bad records (kind, DLQ field, bytes) from the fuzz generator (tests/support/fuzz_records.py), seeded."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    from tests.support.fuzz_records import bad_record

    out: list = []

    @with_seed(seed)
    @settings(max_examples=max(n, 2), database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(bad_record(kinds))
    def collect(x):
        out.append(x)

    collect()
    return out[:n]
