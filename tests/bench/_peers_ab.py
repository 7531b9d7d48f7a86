"""A/B of the producer's batching on the demo pipeline (docs/demo.md "Where the demo's seconds go").

    .venv/bin/python tests/bench/_peers_ab.py [SECONDS] [WORK_DIR]

Two arms of `run_rl` from one warm start (WORK_DIR/demo/warm-model, built by the
demo or tests/bench/peers.py if missing), interleaved A B A B: A as
configs/tiny-cpu.yaml says, B with 32 groups in flight (`max_num_seqs` 256);
SECONDS of RL each, no held-out evaluation during the arms. One JSON line per
arm: trained samples/s, versions, dropped and filtered records, phases.
A helper, not a bench: nothing in CI runs it.
"""
import json, os, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rlstream.common.config import load_config
from rlstream.harness.demo import prepare_warm
from rlstream.harness.arms import arm_metrics
from rlstream.harness.runs import StopRule, run_rl
W = sys.argv[2] if len(sys.argv) > 2 else "runs/peers"
cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml"), [f"model.path={W}/tiny-model", f"producer.prompts.path={W}/data/train.jsonl",
                   f"demo.work_dir={W}/ab", f"kafka.blob_dir={W}/ab-blobs"])
os.makedirs(f"{W}/ab", exist_ok=True)
if not os.path.exists(f"{W}/ab/warm-model") and os.path.exists(f"{W}/demo/warm-model"):
    os.symlink(f"{W}/demo/warm-model", f"{W}/ab/warm-model")
warm = prepare_warm(cfg)
arms = {"A_inflight8": {"producer.max_groups_in_flight": 8, "producer.engine.max_num_seqs": 64},
        "B_inflight32": {"producer.max_groups_in_flight": 32, "producer.engine.max_num_seqs": 256}}
secs = float(sys.argv[1]) if len(sys.argv) > 1 else 90
for rep in range(2):
    for name, ov in arms.items():
        l0 = os.getloadavg()[0]
        res = run_rl(cfg, warm, f"ab-{name}", StopRule(max_seconds=secs), overrides=ov, eval_every_s=1e9)
        m = arm_metrics(res)
        print(json.dumps({"arm": name, "rep": rep, "load": [round(l0, 1), round(os.getloadavg()[0], 1)],
                          "samples_per_s": round(res.samples_per_s, 1), "versions": res.versions,
                          "rl_seconds": res.rl_seconds, "dropped_stale": res.accounting.get("dropped_stale"),
                          "filtered": res.accounting.get("filtered"), "ok": res.ok, "phases": m["phases"]}), flush=True)
