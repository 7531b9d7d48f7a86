"""TRL's arm of tests/bench/peers.py: GRPO on rlstream's tiny MoE, task and reward.

Runs in .venv-peers (`make peers-install`: TRL 1.16.0 layered on .venv, so the
same torch, transformers and vLLM builds), one process, one mode:

    .venv-peers/bin/python tests/bench/_peers_trl.py --mode transformers --model WARM \
        --train train.jsonl --heldout heldout.jsonl --seconds 240 --out trl.json

Modes, in the order a new user tries them (docs/benchmarks.md "Against TRL"):
`async_grpo` (trl.experimental.async_grpo with a vLLM server), `vllm_server`,
`vllm_colocate` (GRPOTrainer with vLLM), `transformers` (GRPOTrainer with
transformers' generate). A mode that cannot run here writes {"ok": false,
"error": <the exception's text>} and exits 0: the bench reports it as is.

The clock starts when this process starts (imports, model load and engine
start count, as rlstream's arm counts its services' start). Every
`--eval-every-s` of training wall time the callback copies the weights (a
few ms); after the budget the copies are scored with rlstream's own held-out
evaluator (ops/harness/evaluate.py `heldout_scores`: avg@8 at the rollout
temperature, the same seed), so evaluation never takes TRL's cores while it
trains (rlstream's evaluations do run beside its services).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

T0 = time.monotonic()
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODES = ("async_grpo", "vllm_server", "vllm_colocate", "transformers")
CHECKS = ("nccl_endpoint",)
"""`nccl_endpoint`: open, alone, the trainer's end of the NCCL weight-transfer group that async GRPO
and server mode open once their vLLM server is up (what they would meet next on this machine)."""


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=MODES + CHECKS, required=True)
    ap.add_argument("--model", required=True, help="the SFT warm start (HF directory)")
    ap.add_argument("--train", required=True)
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=240.0, help="training seconds after the first step (rlstream's arm: RL seconds after its services are up)")
    ap.add_argument("--eval-every-s", type=float, default=15.0)
    ap.add_argument("--settings", type=json.loads, default=None,
                    help="the shared settings as JSON (tests/bench/peers.py `shared_settings`: from rlstream's config)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--metric", default="avg@8")
    ap.add_argument("--eval-limit", type=int, default=None)
    a = ap.parse_args(argv)
    if a.mode in MODES and not a.settings:
        ap.error("--settings is required to train")
    a.settings = SimpleNamespace(**(a.settings or {}))
    return a


# ------------------------------------------------------------------ the shared task

def exact_match_reward():
    """rlstream's verifier (common/tasks/arithmetic.py `is_correct`) as a TRL reward function."""
    from rlstream.common.tasks.arithmetic import is_correct

    def exact_match(completions, answer, **_):
        return [1.0 if is_correct(c, a) else 0.0 for c, a in zip(completions, answer)]
    return exact_match


def train_dataset(path: str):
    from datasets import Dataset

    from rlstream.common.tasks.arithmetic import read_problems

    return Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in read_problems(path)])


def grpo_config(a: argparse.Namespace, out_dir: str, **mode_kw):
    """GRPOConfig set as close to rlstream's MiniRL run (configs/tiny-cpu.yaml) as TRL's options allow."""
    from trl import GRPOConfig

    c = a.settings
    n = c.group_size * c.groups_per_batch
    return GRPOConfig(
        output_dir=out_dir, report_to="none", save_strategy="no", logging_steps=1, seed=c.seed,
        use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0, gradient_checkpointing=False,
        # batch: B groups x G samples per optimizer step, one update per batch (on-policy)
        per_device_train_batch_size=n, gradient_accumulation_steps=1, num_generations=c.group_size,
        steps_per_generation=1, num_iterations=1,
        max_completion_length=c.max_tokens, temperature=c.temperature, top_p=1.0, top_k=0,
        # optimizer: AdamW, constant lr, no warm-up, no weight decay, global grad-norm clip
        optim="adamw_torch", learning_rate=c.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=c.weight_decay, adam_beta1=c.betas[0], adam_beta2=c.betas[1], adam_epsilon=c.adam_eps,
        max_grad_norm=c.grad_clip,
        # loss: mean-centred advantages, token sum over a constant normaliser, no KL term
        beta=0.0, scale_rewards="none", loss_type="dr_grpo", epsilon=c.eps_low, epsilon_high=c.eps_high,
        router_aux_loss_coef=0.0,  # rlstream trains without the load-balancing loss (consumer/train/model.py)
        max_steps=1_000_000, disable_dropout=True, shuffle_dataset=True, **mode_kw)


def vllm_kw(a: argparse.Namespace, mode: str) -> dict:
    """GRPOConfig's vLLM settings: IS correction against the rollout log-probs, per token, truncated at C."""
    kw = dict(use_vllm=True, vllm_mode=mode, vllm_importance_sampling_correction=True,
              vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=a.settings.is_cap,
              vllm_max_model_length=128)
    if mode == "server":
        kw.update(vllm_server_base_url=os.environ.get("TRL_VLLM_URL", "http://127.0.0.1:8000"),
                  vllm_server_timeout=60.0)
    return kw


# ------------------------------------------------------------------ timing

class Clock:
    """Where TRL's seconds go: its own profiling contexts (generate, sync_weights, rewards)
    plus the trainer's step phases, and a weight copy every `every` seconds."""

    def __init__(self, deadline: float, every: float):
        self.deadline, self.every = deadline, every
        self.phases: dict[str, float] = defaultdict(float)
        self.snapshots: list[dict] = []
        self.steps = self.samples = 0
        self.first_step_at: float | None = None
        self.last_snap = -1e9
        self.opt_t = 0.0

    def install(self) -> None:
        from trl.extras import profiling

        clock = self

        def _log_metrics(ctx, duration: float) -> None:
            clock.phases[ctx.name] += duration
        profiling.ProfilingContext._log_metrics = _log_metrics

    def timed(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.phases[phase] += time.perf_counter() - t
        setattr(obj, name, wrapper)

    def snapshot(self, model, step: int) -> None:
        import torch

        t = time.monotonic() - T0
        with torch.no_grad():
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.snapshots.append({"time": round(t, 2), "step": step, "state": state})
        self.last_snap = t


def callback(clock: Clock, samples_per_step: int):
    from transformers import TrainerCallback

    class Budget(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if clock.first_step_at is None:
                clock.first_step_at = time.monotonic() - T0
                clock.snapshot(kw["model"], 0)

        def on_pre_optimizer_step(self, args, state, control, **kw):
            clock.opt_t = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kw):
            clock.phases["optimizer_step"] += time.perf_counter() - clock.opt_t

        def on_step_end(self, args, state, control, model=None, **kw):
            clock.steps, clock.samples = state.global_step, state.global_step * samples_per_step
            now = time.monotonic() - T0
            if now - clock.last_snap >= clock.every:
                clock.snapshot(model, state.global_step)
            if now - clock.first_step_at >= clock.deadline:  # as rlstream's RL seconds: after start-up
                clock.snapshot(model, state.global_step)
                control.should_training_stop = True
            return control
    return Budget()


# ------------------------------------------------------------------ the modes

def run_grpo(a: argparse.Namespace, clock: Clock, mode_kw: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="trl-peers-") as out:
        trainer = GRPOTrainer(model=model, reward_funcs=exact_match_reward(), args=grpo_config(a, out, **mode_kw),
                              train_dataset=train_dataset(a.train), processing_class=tok,
                              callbacks=[callback(clock, a.settings.group_size * a.settings.groups_per_batch)])
        clock.timed(trainer, "_generate_and_score_completions", "generate_and_score")
        clock.timed(trainer, "training_step", "training_step")
        trainer.train()
    return {"model": model}


def run_async_grpo(a: argparse.Namespace, clock: Clock) -> dict:
    """trl.experimental.async_grpo: needs a running vLLM server (`trl vllm-serve` / `vllm serve`
    with the weight-transfer engine) at TRL_VLLM_URL."""
    import torch
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    c = a.settings
    n = c.group_size * c.groups_per_batch
    with tempfile.TemporaryDirectory(prefix="trl-peers-") as out:
        cfg = AsyncGRPOConfig(
            output_dir=out, report_to="none", save_strategy="no", seed=c.seed, use_cpu=True, bf16=False,
            dtype="float32", gradient_checkpointing=False, per_device_train_batch_size=n,
            num_generations=c.group_size, max_completion_length=c.max_tokens, temperature=c.temperature,
            learning_rate=c.lr, max_grad_norm=c.grad_clip, epsilon=c.eps_low, epsilon_high=c.eps_high,
            max_staleness=c.max_staleness, max_steps=1_000_000,
            vllm_server_base_url=os.environ.get("TRL_VLLM_URL", "http://127.0.0.1:8000"), vllm_server_timeout=60.0)
        trainer = AsyncGRPOTrainer(model=a.model, reward_funcs=exact_match_reward(), args=cfg,
                                   train_dataset=train_dataset(a.train),
                                   callbacks=[callback(clock, n)])
        trainer.train()
        return {"model": trainer.model if hasattr(trainer, "model") else torch.nn.Module()}


# ------------------------------------------------------------------ scoring

def score(a: argparse.Namespace, model, snapshots: list[dict]) -> list[dict]:
    """Held-out scores of every weight copy, with rlstream's evaluator (seed 0, like its VersionEvaluator)."""
    from transformers import AutoTokenizer

    from rlstream.harness.evaluate import heldout_scores
    from rlstream.common.tasks.arithmetic import read_problems

    tok = AutoTokenizer.from_pretrained(a.model)
    problems = read_problems(a.heldout, a.eval_limit)
    model.eval()
    rows = []
    for s in snapshots:
        model.load_state_dict(s["state"])
        r = heldout_scores(model, tok, problems, a.metric, a.settings.temperature, a.settings.max_tokens)
        rows.append({"time": s["time"], "step": s["step"], "heldout_accuracy": r["accuracy"],
                     "heldout_greedy": r["greedy"], "eval_seconds": round(r["seconds"], 2)})
    return rows


def nccl_endpoint() -> None:
    """TRL's async GRPO weight-transfer trainer endpoint (the same call `WeightTransferClient` makes)."""
    from trl.experimental.async_grpo.weight_transfer import open_trainer_endpoint

    open_trainer_endpoint({"master_address": "127.0.0.1", "master_port": 29591, "rank_offset": 1,
                           "world_size": 1, "packed": True})


def main(argv=None) -> int:
    a = parse(argv)
    import torch

    torch.set_num_threads(a.threads)
    torch.manual_seed(getattr(a.settings, "seed", 0))
    clock = Clock(deadline=a.seconds, every=a.eval_every_s)
    result: dict = {"mode": a.mode, "ok": False, "threads": a.threads}
    try:
        import trl

        result["trl_version"] = trl.__version__
        clock.install()
        if a.mode == "nccl_endpoint":
            nccl_endpoint()
            result.update(ok=True)
            return _write(a, result)
        if a.mode == "async_grpo":
            got = run_async_grpo(a, clock)
        else:
            kw = {} if a.mode == "transformers" else vllm_kw(a, a.mode.removeprefix("vllm_"))
            got = run_grpo(a, clock, kw)
        wall = time.monotonic() - T0
        result.update(ok=True, wall_seconds=round(wall, 2), startup_seconds=clock.first_step_at,
                      steps=clock.steps, samples=clock.samples,
                      train_seconds=round(wall - (clock.first_step_at or 0.0), 2),
                      phases={k: round(v, 2) for k, v in sorted(clock.phases.items())})
        result["samples_per_s"] = clock.samples / max(result["train_seconds"], 1e-9)
        torch.set_num_threads(1)  # as rlstream's evaluator
        result["evals"] = score(a, got["model"], clock.snapshots)
    except BaseException as e:  # noqa: BLE001 - the bench reports why a mode did not run
        result["error"] = f"{type(e).__name__}: {e}"[:2000]
        result["traceback_tail"] = traceback.format_exc()[-3000:]
    return _write(a, result)


def _write(a: argparse.Namespace, result: dict) -> int:
    Path(a.out).write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "traceback_tail"})[:4000], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
