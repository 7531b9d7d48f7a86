"""`rlstream demo`: the whole pipeline, end to end, on one CPU machine.

    make demo          # = rlstream demo -c configs/tiny-cpu.yaml

Steps (docs/demo.md has the measured timings):

    prepare   build the tiny MoE + tokenizer and the arithmetic task (ops/toy/build.py),
              warm-start it by SFT until it solves a minority of held-out problems
              (ops/harness/sft.py; reused when inputs are unchanged), score it
    start     `rlstream broker`, N x `rlstream producer`, one `rlstream consumer`,
              each a separate process with its own log, env, HTTP port and run file
              (ops/harness/supervisor.py)
    watch     every few seconds: scrape /metrics of every service, print one
              progress line, append it to progress.jsonl; evaluate the newest weight
              version's held-out accuracy (ops/harness/observe.py, evaluate.py)
    stop      when accuracy >= warm + demo.target_gain on two evaluations in a
              row, or at demo.max_minutes: SIGTERM producers (they drain), let the
              consumer take in the rest, SIGTERM it, then the broker
    account   every process exited 0, every published record has an outcome
              (ops/harness/census.py)
    report    report.md + PNG plots (ops/harness/report.py)

start -> account is one `run_rl` (ops/harness/runs.py), shared with
`rlstream experiment` (ops/harness/experiments.py) and the end-to-end test;
`prepare_warm` is shared with them too.
"""
from __future__ import annotations

import time
from pathlib import Path

from rlstream.common.config import RlstreamConfig
from rlstream.common.tasks.arithmetic import read_problems
from rlstream.harness.evaluate import heldout_scores
from rlstream.harness.hf_decode import load_model
from rlstream.harness.report import write_report
from rlstream.harness.runs import StopRule, Warm, run_rl, say
from rlstream.harness.sft import SftConfig, ToolSft, warm_start
from rlstream.toy.build import ensure_model, task_files

# leave time for engine start (~40 s), shutdown and the report within the budget
_RESERVE_S = 120.0


def main(cfg: RlstreamConfig) -> int:
    t0 = time.monotonic()
    d = cfg.demo
    say(f"rlstream demo: budget {d.max_minutes:g} min, target +{d.target_gain:.2f} "
        f"held-out accuracy over the warm start, {d.num_producers} producer(s)")
    warm = prepare_warm(cfg)
    target = min(1.0, warm.accuracy + d.target_gain)
    rl_budget = max(60.0, d.max_minutes * 60 - (time.monotonic() - t0) - _RESERVE_S)
    res = run_rl(cfg, warm, "demo", StopRule(target_accuracy=target, max_seconds=rl_budget),
                 tick_s=d.progress_every_s, eval_every_s=d.eval_every_s)
    wall = time.monotonic() - t0
    out = write_report(Path(res.run_dir) / "progress.jsonl", Path(res.run_dir) / "report",
                       {**res.summary(), "metric": warm.metric, "warm_greedy_accuracy": warm.greedy_accuracy,
                        "target_accuracy": target, "sft_seconds": warm.sft_seconds,
                        "sft_steps": warm.sft_steps, "sft_reused": warm.reused, "demo_wall_seconds": wall})
    say(f"report: {out}")
    ok = res.ok and res.reached_target
    final = res.final_accuracy if res.final_accuracy is not None else float("nan")
    say(f"demo {'succeeded' if ok else 'FAILED'}: held-out accuracy {warm.accuracy:.3f} -> {final:.3f} "
        f"(best {res.best_accuracy or 0:.3f}, target {target:.3f}) in {wall / 60:.1f} min")
    return 0 if ok else 1


def prepare_warm(cfg: RlstreamConfig, reuse: bool | None = None) -> Warm:
    """Base model + task data (ops/toy/build.py `task_files`: the toy task or a
    reasoning-gym task's split), the SFT warm start under
    demo.work_dir (reused when its inputs are unchanged), and its held-out score."""
    d = cfg.demo
    base, (train, heldout) = ensure_model(cfg), task_files(cfg)
    sft_cfg = SftConfig(band_low=d.sft_band_low, band_high=d.sft_band_high, max_steps=d.sft_max_steps,
                        seed=cfg.producer.prompts.seed)
    out = Path(d.work_dir) / "warm-model"
    t0 = time.monotonic()
    res = warm_start(base, out, train, heldout, sft_cfg, reuse=d.reuse_warm_start if reuse is None else reuse,
                     progress=say)
    if not res.in_band:
        say(f"warning: SFT ended at held-out accuracy {res.accuracy:.3f}, outside "
            f"[{sft_cfg.band_low}, {sft_cfg.band_high}] (step cap or a jump over the band)")
    if cfg.producer.episodes is not None:
        out, res = _tool_warm_start(cfg, out, train, heldout, d.reuse_warm_start if reuse is None else reuse)
    scores = score_dir(out, heldout, d.eval_metric, cfg.producer.temperature, cfg.producer.max_tokens,
                       cfg.producer.episodes)
    tool = "" if cfg.producer.episodes is None else (f" with the tool, {scores['no_tool']:.3f} greedy without, "
                                                     f"tool call rate {scores['call_rate']:.2f}")
    say(f"warm start: held-out {d.eval_metric} accuracy {scores['accuracy']:.3f} (greedy {scores['greedy']:.3f})"
        f"{tool} after {res.steps} SFT steps ({'reused' if res.reused else f'{time.monotonic() - t0:.0f} s'})")
    return Warm(out.resolve(), train.resolve(), heldout.resolve(), scores["accuracy"], res.seconds,
                res.steps, res.reused, d.eval_metric, scores["greedy"], scores)


def _tool_warm_start(cfg: RlstreamConfig, plain: Path, train: Path, heldout: Path, reuse: bool):
    """(directory, SftResult) of the second SFT stage: the plain warm start taught the
    call format of `producer.episodes`' environment (ops/harness/sft.py `ToolSft`)."""
    d = cfg.demo
    sft_cfg = SftConfig(band_low=d.sft_tool_band_low, band_high=d.sft_tool_band_high,
                        max_steps=d.sft_tool_max_steps, eval_every=20, eval_limit=128,
                        seed=cfg.producer.prompts.seed)
    out = Path(d.work_dir) / "tool-warm-model"
    res = warm_start(plain, out, train, heldout, sft_cfg, reuse=reuse, progress=say,
                     tool=ToolSft(cfg.producer.episodes, d.sft_tool_traces))
    if not res.in_band:
        say(f"warning: the tool-format SFT ended at held-out accuracy {res.accuracy:.3f} with the tool, outside "
            f"[{sft_cfg.band_low}, {sft_cfg.band_high}]")
    return out, res


def score_dir(model_dir, heldout, metric: str, temperature: float, max_new_tokens: int, episodes=None) -> dict:
    """`rlstream.harness.evaluate.heldout_scores` of a model directory (seeded sampling;
    with `episodes`, scored with the tool and without)."""
    import torch

    threads = torch.get_num_threads()
    model, tok = load_model(model_dir)
    try:
        return heldout_scores(model, tok, read_problems(heldout), metric, temperature, max_new_tokens,
                              episodes=episodes)
    finally:
        torch.set_num_threads(threads)
