"""What one trained step took: the `inputs` of its audit line (`<checkpoint_dir>/trained.jsonl`).

    {"schema": 1,
     "topic": "rlstream.rollouts",
     "records": [[partition, offset], ...],  # batch order (group by group, sample_idx order): the
                                             # line's `trained` ids, one for one
     "staleness": [s, ...],                  # per record, what the gate measured (in steps)
     "control": {"max_staleness", "mode", "decay", "paused"},   # in force for the step's batch
     "dynamic_sampling": bool,               # the gate filtered zero-variance groups
     "settings": "<16 hex>",                 # digest of the trainer settings (SETTINGS_KEYS)
     "world": n,                             # processes that trained the step
     "metrics": {...}}                       # the step's metrics, timings left out

Why each is here. The records are the step's data (the ids alone cannot be
read back: Kafka is read by offset). The control settings change while a run
goes on, and the control topic is compacted: it keeps only the newest value of
each key, so the history of what held at step N lives here, one copy per step.
Staleness is what the gate measured with its clock (consumer/stream/gate.py
GateClock: in optimizer steps of the lineage, across crashes); with the control
settings it gives each sample's weight through the gate's own code. The
trainer draws no random numbers (no dropout, mini-batches cut in record order),
so there is no seed to record; Megatron's CUDA RNG seed is a constant of
consumer/train/parallel.py. The metrics are what a replay is compared with.

A reader refuses a schema it does not know (`StepInputs.parse`): a replay of a
newer consumer's log by an older rlstream fails with a clear error instead of
guessing. Audit lines written before schema 1 have no `inputs`: such a step
cannot be replayed (the error says so).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from rlstream.consumer.logreplay import ReplayError

INPUTS_SCHEMA = 1
"""The version of the `inputs` this rlstream writes and reads (append-only: a new field
that older readers may ignore keeps it; anything else raises it)."""

SETTINGS_KEYS = {"group_size", "num_minibatches", "replay", "dtype", "loss", "optimizer", "parallel",
                 "num_threads", "dynamic_sampling", "memory"}
"""The consumer settings a step's result depends on (memory: the micro-batch plan and
kernels; num_threads: CPU reductions split by thread)."""


def settings_digest(ccfg) -> str:
    """16 hex digits of sha256 over the trainer settings of `ccfg` (ConsumerSettings)."""
    d = ccfg.model_dump(mode="json", include=SETTINGS_KEYS)
    d["memory"].pop("device_memory_gb", None)  # a planning figure, not a kernel choice
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def compared_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics a replay must reproduce: all but wall-clock timings."""
    return {k: v for k, v in metrics.items() if not k.startswith("time_") and k != "step_overhead_share"}


def step_inputs(batch, staleness, control, ccfg, topic: str, metrics: dict, world: int) -> dict[str, Any]:
    """The `inputs` of the audit line of a step that trained `batch` (ReadyGroups).
    `staleness`: the gate's per-sample function at the step the batch was gated at."""
    records, stale = [], []
    for rg in batch:
        for i in sorted(rg.group.samples):
            held = rg.group.samples[i]
            records.append([held.partition, held.offset])
            stale.append(int(staleness(held.rollout)))
    return {"schema": INPUTS_SCHEMA, "topic": topic, "records": records, "staleness": stale,
            "control": control.model_dump(mode="json"), "dynamic_sampling": bool(ccfg.filters_zero_variance),
            "settings": settings_digest(ccfg), "world": int(world), "metrics": compared_metrics(metrics)}


@dataclass(frozen=True)
class StepInputs:
    """One step's `inputs`, checked."""

    step: int
    trained: list[str]
    topic: str
    records: list[tuple[int, int]]
    staleness: list[int]
    control: dict[str, Any]
    dynamic_sampling: bool
    settings: str
    world: int
    metrics: dict[str, Any]

    @classmethod
    def parse(cls, entry: dict[str, Any]) -> "StepInputs":
        """From an audit line; ReplayError if it has no inputs, an unknown schema or a bad shape."""
        step = entry.get("step")
        d = entry.get("inputs")
        if d is None:
            raise ReplayError(f"step {step}: its audit line has no step inputs (written by an rlstream "
                              "before replay existed); replay from a checkpoint at or after it (--from)")
        if not isinstance(d, dict) or d.get("schema") != INPUTS_SCHEMA:
            have = d.get("schema") if isinstance(d, dict) else type(d).__name__
            raise ReplayError(f"step {step}: step inputs of schema {have!r}, this rlstream reads schema "
                              f"{INPUTS_SCHEMA} only; replay with the rlstream version that wrote the run")
        try:
            out = cls(step=int(step), trained=[str(r) for r in entry["trained"]], topic=str(d["topic"]),
                      records=[(int(p), int(o)) for p, o in d["records"]],
                      staleness=[int(s) for s in d["staleness"]], control=dict(d["control"]),
                      dynamic_sampling=bool(d["dynamic_sampling"]), settings=str(d["settings"]),
                      world=int(d["world"]), metrics=dict(d["metrics"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ReplayError(f"step {step}: malformed step inputs ({type(e).__name__}: {e}); "
                              "the audit log was edited or torn") from None
        if not len(out.records) == len(out.staleness) == len(out.trained):
            raise ReplayError(f"step {step}: {len(out.records)} records, {len(out.staleness)} staleness values "
                              f"and {len(out.trained)} trained ids: the audit line is inconsistent")
        return out
