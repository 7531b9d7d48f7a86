"""Wire benchmark: record size per token, codec speed vs naive msgpack lists, broker path vs raw kafka-python.

Run: .venv/bin/python tests/bench/wire.py   (starts its own tansu broker; ~1 minute on 2 cores)
Prints ONE JSON object. Shape: Qwen3-30B-A3B (48 MoE layers, top-8 of 128 experts),
4,096 response tokens after a 256-token prompt, routing for every input token.

- routing_bytes_per_token, ids_logprobs_bytes_per_token: bytes of those fields on the wire / tokens
- encode_decode_speedup_vs_naive: (naive encode+decode time) / (ours), same record, same run; naive =
  msgpack of Python lists (`.tolist()` + packb, unpackb)
- broker_vs_raw_ratio: MB/s of publish-all-then-read-all through RolloutPublisher + RolloutReader
  (encode, validate, decode included) / MB/s of raw KafkaProducer sends + KafkaConsumer reads of the
  same bytes, same broker, same fetch sizes; best of `ROUNDS` alternating rounds each
Targets: routing <= 384 B/token, ids+logprobs 8 B/token, speedup >= 50, broker_vs_raw_ratio >= 0.8.
"""
from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.kafka.broker import EmbeddedBroker  # noqa: E402
from common.config import BrokerSettings  # noqa: E402
from common.kafka.client import FETCH_OVERHEAD_BYTES, client_kwargs  # noqa: E402
from common.kafka.publisher import RolloutPublisher  # noqa: E402
from common.kafka.reader import RolloutReader  # noqa: E402
from common.record import decode, encode  # noqa: E402
from tests.fixtures.kafka import make_kafka_settings, realistic_rollout  # noqa: E402

T, P, LAYERS, TOP_K, EXPERTS = 4096, 256, 48, 8, 128
N_RECORDS = 48          # ~80 MB per pass
ROUNDS = 5
MB = 1e6


# ------------------------------------------------------------------ codec

def wire_sizes(r) -> dict:
    m = msgpack.unpackb(encode(r))
    rows = r.routed_experts.shape[0]
    return {
        "record_bytes": len(encode(r)),
        "routing_bytes_per_token": len(m["routed_experts"]) / rows,
        "ids_logprobs_bytes_per_token": (len(m["response_ids"]) + len(m["logprobs"])) / r.num_tokens,
    }


def naive_encode(r) -> bytes:
    return msgpack.packb({
        "rollout_id": r.rollout_id, "group_id": r.group_id, "sample_idx": r.sample_idx,
        "group_size": r.group_size, "prompt_ids": r.prompt_ids.tolist(), "response_ids": r.response_ids.tolist(),
        "logprobs": r.logprobs.tolist(), "policy_version": r.policy_version, "reward": r.reward,
        "token_versions": r.token_versions.tolist(), "routed_experts": r.routed_experts.tolist(),
        "num_experts": r.num_experts, "finish_reason": r.finish_reason,
    })


def best_time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def codec(r) -> dict:
    buf = encode(r)
    ours = best_time(lambda: decode(encode(r)), 20)
    naive = best_time(lambda: msgpack.unpackb(naive_encode(r)), 3)
    return {
        "encode_decode_seconds_per_record": ours,
        "naive_encode_decode_seconds_per_record": naive,
        "encode_decode_MBps": len(buf) / ours / MB,
        "naive_encode_decode_MBps": len(buf) / naive / MB,
        "encode_decode_speedup_vs_naive": naive / ours,
    }


# ----------------------------------------------------------------- broker

def ours_pass(kafka, rollouts) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    with RolloutPublisher(kafka) as pub:
        futs = [pub.publish(r) for r in rollouts]
        pub.flush(120)
        nbytes = sum(f.result().nbytes for f in futs)
    t1 = time.perf_counter()
    with RolloutReader(kafka) as rd:
        n = 0
        while n < len(rollouts):
            n += len(rd.poll(max_records=64, timeout_s=1.0))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, nbytes


def raw_pass(kafka, topic: str, records: list[tuple[bytes, bytes]]) -> tuple[float, float, int]:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    kw = client_kwargs(kafka)
    t0 = time.perf_counter()
    p = KafkaProducer(**kw, max_request_size=kafka.max_message_bytes)
    for k, v in records:
        p.send(topic, key=k, value=v)
    p.flush(120)
    p.close()
    t1 = time.perf_counter()
    per = kafka.max_message_bytes + FETCH_OVERHEAD_BYTES
    c = KafkaConsumer(**kw, group_id=None, enable_auto_commit=False, fetch_max_bytes=max(52_428_800, per),
                      max_partition_fetch_bytes=per, receive_message_max_bytes=max(52_428_800, per) + FETCH_OVERHEAD_BYTES,
                      fetch_max_wait_ms=100)
    tps = [TopicPartition(topic, i) for i in sorted(c.partitions_for_topic(topic))]
    c.assign(tps)
    c.seek_to_beginning(*tps)
    n = 0
    while n < len(records):
        n += sum(len(b) for b in c.poll(timeout_ms=1000, max_records=64).values())
    c.close()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, sum(len(v) for _, v in records)


def broker_bench(rollouts) -> dict:
    logging.getLogger("kafka").setLevel(logging.ERROR)
    records = [(r.group_id.encode(), encode(r)) for r in rollouts]
    best = {"ours": None, "raw": None}
    with EmbeddedBroker(BrokerSettings(port=0)) as b, tempfile.TemporaryDirectory() as blobs:
        warm = make_kafka_settings(b.bootstrap, blobs)
        ours_pass(warm, rollouts[:4])
        warm_raw = make_kafka_settings(b.bootstrap, blobs)
        raw_pass(warm_raw, warm_raw.topics.rollouts, records[:4])
        for _ in range(ROUNDS):  # alternate, fresh topics per pass, keep the best of each
            for name in ("raw", "ours"):
                k = make_kafka_settings(b.bootstrap, blobs)
                pub_s, read_s, nbytes = (ours_pass(k, rollouts) if name == "ours"
                                         else raw_pass(k, k.topics.rollouts, records))
                res = {"publish_MBps": nbytes / pub_s / MB, "read_MBps": nbytes / read_s / MB,
                       "end_to_end_MBps": nbytes / (pub_s + read_s) / MB}
                if best[name] is None or res["end_to_end_MBps"] > best[name]["end_to_end_MBps"]:
                    best[name] = res
    out = {f"{name}_{k}": round(v, 1) for name, res in best.items() for k, v in res.items()}
    out["broker_vs_raw_ratio"] = round(best["ours"]["end_to_end_MBps"] / best["raw"]["end_to_end_MBps"], 3)
    out["broker_records_per_pass"] = len(rollouts)
    out["broker_MB_per_pass"] = round(sum(len(v) for _, v in records) / MB, 1)
    return out


def main() -> dict:
    t0 = time.perf_counter()
    r = realistic_rollout(response_tokens=T, prompt_tokens=P, layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS)
    result = {"shape": f"Qwen3-30B-A3B: P={P} T={T} layers={LAYERS} top_k={TOP_K} experts={EXPERTS}"}
    result.update({k: round(v, 2) if isinstance(v, float) else v for k, v in wire_sizes(r).items()})
    result.update({k: round(v, 5 if "seconds" in k else 1) for k, v in codec(r).items()})
    rollouts = [realistic_rollout(response_tokens=T, prompt_tokens=P, layers=LAYERS, top_k=TOP_K,
                                  num_experts=EXPERTS, seed=i, group_id=f"g{i // 8}", sample_idx=i % 8)
                for i in range(N_RECORDS)]
    result.update(broker_bench(rollouts))
    result["targets_met"] = {
        "routing_bytes_per_token<=384": result["routing_bytes_per_token"] <= 384,
        "ids_logprobs_bytes_per_token==8": result["ids_logprobs_bytes_per_token"] == 8,
        "encode_decode_speedup_vs_naive>=50": result["encode_decode_speedup_vs_naive"] >= 50,
        "broker_vs_raw_ratio>=0.8": result["broker_vs_raw_ratio"] >= 0.8,
    }
    result["bench_seconds"] = round(time.perf_counter() - t0, 1)
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
