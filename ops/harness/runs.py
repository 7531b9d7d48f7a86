"""One RL run of the whole pipeline, from a warm start: the piece the demo, the experiments and the end-to-end test share.

    res = run_rl(cfg, warm, "demo", StopRule(target_accuracy=0.3, max_seconds=600))

`run_rl` reads top to bottom:

    run dir    a fresh `<demo.work_dir>/runs/<label>-<time>/` (`RunDirs`) and
               its config.yaml: the warm model, fresh weight/checkpoint/blob
               stores, the caller's overrides (`write_run_config`)
    start      broker, consumer, producers as processes (`Pipeline`)
    watch      every `tick_s`: one scrape of every service -> a progress row
               and line; every `eval_every_s`: held-out accuracy of the newest
               weight version (`VersionEvaluator`); until `StopRule`
    stop       producers drain (SIGTERM), the rollouts topic is read back,
               the consumer takes in the rest and stops, then the broker
    account    published == every outcome + held, from the census and the
               consumer's final counters (its run file's stop record)

and returns a `RunResult`; progress.jsonl and summary.json are written to the
run directory whatever happened. A failing service ends the run with its
log tail in `RunResult.error`; processes never outlive the run.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlstream.common.config import RlstreamConfig, set_path
from rlstream.common.errors import PipelineError
from rlstream.harness.census import TopicCensus, account, topic_census
from rlstream.harness.evaluate import VersionEvaluator
from rlstream.harness.observe import Metrics, Observer, metric, quiesce
from rlstream.harness.supervisor import Pipeline
from rlstream.consumer.stream.ledger import OUTCOMES

log = logging.getLogger("rlstream.runs")


def say(msg: str) -> None:
    """Progress for the person watching (stdout, flushed); logs go to stderr."""
    print(msg, flush=True)


# ---------------------------------------------------------------------------- inputs

@dataclass
class Warm:
    """The SFT warm start every run begins from (ops/harness/demo.py `prepare_warm`)."""

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
    scores: dict = field(default_factory=dict)
    """Every held-out score of the warm model (`heldout_scores`: with the tool and without for episodes)."""


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


def write_run_config(cfg: RlstreamConfig, dirs: RunDirs, warm: Warm,
                     overrides: dict[str, Any] | None = None) -> RlstreamConfig:
    """The resolved config of one run: the warm model, fresh stores under the run dir.

    Per-process settings (ports, producer ids, seeds, run files) are not here:
    the supervisor passes them on each command line.
    """
    data = cfg.model_dump(mode="json")
    # a JSONL source reads the warm start's training file; other sources bring their own prompts
    prompts = {"producer.prompts.path": str(warm.train_path)} if cfg.producer.prompts.type == "jsonl" else {}
    for k, v in {"model.path": str(warm.model_dir), "model.build_tiny": False, **prompts,
                 "consumer.weight_store_dir": str(dirs.weights),
                 "consumer.checkpoint_dir": str(dirs.checkpoints),
                 "kafka.blob_dir": str(dirs.blobs), **(overrides or {})}.items():
        set_path(data, k, v, "the run's overrides")
    run_cfg = RlstreamConfig.model_validate(data)
    dirs.config.write_text(yaml.safe_dump(run_cfg.model_dump(mode="json"), sort_keys=False))
    os.chmod(dirs.config, 0o600)  # may hold SASL credentials of a real cluster
    return run_cfg


ADMIN_TOKEN_FILE = "admin_token"
"""In a run directory: the admin token minted for the run (mode 0600), when none was set."""


def run_admin_env(cfg: RlstreamConfig, dirs: RunDirs) -> dict[str, str]:
    """The services' environment for the run's admin token. A token signs every control record
    (an operator's `rlstream ctl set`, the `max_staleness: auto` controller's changes) and the
    services apply no unsigned one, so a run without a token could never change a setting. When
    neither the environment (RLSTREAM_ADMIN_TOKEN) nor the config sets one, one is minted for the
    run: passed to the services in their environment, not in the run's config file, and kept in
    `<run dir>/admin_token` (0600) for `rlstream ctl --token`."""
    if os.environ.get("RLSTREAM_ADMIN_TOKEN") or cfg.cli.admin_token or cfg.consumer.http.admin_token\
            or cfg.producer.http.admin_token:
        return {}
    token = secrets.token_urlsafe(24)
    path = dirs.root / ADMIN_TOKEN_FILE
    path.touch(mode=0o600)
    path.write_text(token + "\n")
    say(f"admin token for this run (none was set): {path}")
    return {"RLSTREAM_ADMIN_TOKEN": token}


@dataclass
class StopRule:
    """When a run ends (whichever comes first)."""

    target_accuracy: float | None = None
    confirmations: int = 2
    """Consecutive evaluations at or above the target."""
    max_seconds: float = 600.0
    max_versions: int | None = None


# ---------------------------------------------------------------------------- outputs

@dataclass
class RunResult:
    label: str
    run_dir: str
    warm_accuracy: float
    final_accuracy: float | None = None
    best_accuracy: float | None = None
    reached_target: bool = False
    seconds_to_target: float | None = None
    rl_seconds: float = 0.0
    startup_seconds: float = 0.0
    versions: int = 0
    samples_per_s: float = 0.0
    exit_codes: dict[str, int] = field(default_factory=dict)
    accounting: dict = field(default_factory=dict)
    error: str | None = None
    rows: list[dict] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return (self.error is None and all(c == 0 for c in self.exit_codes.values())
                and bool(self.accounting.get("ok")))

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "rows"}


@dataclass
class Shutdown:
    exit_codes: dict[str, int]
    published: TopicCensus | None
    outcomes: dict[str, float] | None
    """The consumer's final outcome counters (None: unknown)."""
    held: int | None
    """Records it held when it stopped (None: unknown)."""
    quiesce_seconds: float


# ---------------------------------------------------------------------------- one run

def run_rl(cfg: RlstreamConfig, warm: Warm, label: str, stop: StopRule,
           overrides: dict[str, Any] | None = None, tick_s: float = 5.0,
           eval_every_s: float = 15.0, num_producers: int | None = None) -> RunResult:
    """One run: fresh run dir, start the services, watch until `stop`, shut down, account."""
    import torch

    torch.set_num_threads(1)  # the services own the cores; evaluation is small
    dirs = new_run_dir(cfg.demo.work_dir, label)
    run_cfg = write_run_config(cfg, dirs, warm, overrides)
    pipe = Pipeline(run_cfg, dirs.config, dirs.logs, num_producers or cfg.demo.num_producers,
                    env=run_admin_env(run_cfg, dirs))
    evaluator = VersionEvaluator(dirs.weights, warm.heldout_path, warm.metric, run_cfg.producer.temperature,
                                 run_cfg.producer.max_tokens, episodes=run_cfg.producer.episodes)
    # the warm start is version 0 (the consumer publishes it unchanged as v0)
    rows: list[dict] = [{"kind": "eval", "time": 0.0, "version": 0, "heldout_accuracy": warm.accuracy,
                         "heldout_greedy": warm.greedy_accuracy, "metric": warm.metric, "source": "warm start"}]
    t_start = time.monotonic()
    res = RunResult(label, str(dirs.root), warm.accuracy)
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
        _final_eval(evaluator, rows, res)
        dirs.progress.write_text("".join(json.dumps(r) + "\n" for r in rows))
        res.rows = rows
        (dirs.root / "summary.json").write_text(json.dumps(res.summary(), indent=1))
    return res


_MIN_SLEEP_S = 1.0
"""Shortest wait between two scrapes (when an evaluation is due but no new version exists yet)."""


def _watch(pipe: Pipeline, evaluator: VersionEvaluator, stop: StopRule, rows: list[dict],
           res: RunResult, tick_s: float, eval_every_s: float) -> None:
    obs = Observer()
    hits, acc = 0, None
    while True:
        # wake for the next progress row or the next evaluation, whichever comes first: evaluations
        # on a tick grid would come every ceil(eval_every_s / tick_s) ticks (15 s -> 20 s at 5 s ticks)
        time.sleep(min(tick_s, max(_MIN_SLEEP_S, evaluator.seconds_until_due(eval_every_s))))
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


def _progress_line(row: dict, acc: tuple[int, dict] | None, warm: float) -> str:
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    acc_s = "-" if acc is None else f"{acc[1]['accuracy']:.3f}@v{acc[0]}"
    o = row["outcomes"]
    return (f"[{int(row['time']) // 60:2d}:{int(row['time']) % 60:02d}] v={row['version']:<4d} "
            f"reward={f(row['reward_mean'], '.3f')} heldout={acc_s} (warm {warm:.3f}) "
            f"kl={f(row['kl'], '.2e')} stale={f(row['staleness_mean'], '.2f')} "
            f"samples/s={row['samples_per_s']:.1f} trained={o['trained']} "
            f"dropped={o['dropped_stale']} filtered={o['filtered']} timed_out={o['timed_out']} dlq={o['dlq']}")


# ---------------------------------------------------------------------------- stop + account

def stop_pipeline(pipe: Pipeline, quiesce_timeout_s: float = 60.0) -> Shutdown:
    """Producers (drain) -> read the topic back -> consumer takes in the rest -> consumer -> broker."""
    for p in pipe.producers:
        p.terminate()
    codes = {p.name: p.wait(pipe.stop_timeout_s) for p in pipe.producers}
    published = _census(pipe) if pipe.services and pipe.broker.alive else None
    outcomes, held, waited = None, None, 0.0
    consumer = pipe.consumer
    if consumer is not None:
        scraped, waited = quiesce(consumer, quiesce_timeout_s)
        codes["consumer"] = consumer.stop(pipe.stop_timeout_s)
        outcomes, held = _consumer_counters(consumer.final(), scraped)
    if pipe.services:
        pipe.broker.terminate()
        codes["broker"] = pipe.broker.wait(30.0)
    return Shutdown(codes, published, outcomes, held, waited)


def _census(pipe: Pipeline, timeout_s: float = 60.0) -> TopicCensus | None:
    """The rollouts topic read back; None (reported as unknown) if that failed."""
    try:
        return topic_census(pipe.cfg.kafka.model_copy(update={"bootstrap_servers": pipe.bootstrap}), timeout_s)
    except Exception as e:  # noqa: BLE001 - accounting reports it as unknown
        log.error("could not read the rollouts topic: %s", e)
        return None


def _consumer_counters(final: dict | None, scraped: Metrics | None) -> tuple[dict | None, int | None]:
    """(outcomes, held): exact from the stop record of the consumer's run file; if it
    did not stop cleanly, its last scrape (held None when it exports no gauge)."""
    if final is not None:
        return dict(final["outcomes"]), int(final["held"])
    if scraped is None:
        return None, None
    gauge = metric(scraped, "rlstream_consumer_held_records", default=float("nan"))
    outcomes = {o: metric(scraped, "rlstream_consumer_records_total", outcome=o) for o in OUTCOMES}
    return outcomes, (None if gauge != gauge else int(gauge))


def _shutdown(pipe: Pipeline, run_cfg: RlstreamConfig, res: RunResult) -> None:
    say("stopping: producers drain, consumer takes in the rest, then the broker")
    try:
        sd = stop_pipeline(pipe)
        res.exit_codes = sd.exit_codes
        res.accounting = account(sd.published, sd.outcomes, sd.held, run_cfg.consumer.group_size,
                                 run_cfg.consumer.groups_per_batch)
        trained = res.accounting.get("trained") or 0
        res.samples_per_s = trained / res.rl_seconds if res.rl_seconds else 0.0
    except Exception as e:  # noqa: BLE001 - never leave processes behind
        res.error = res.error or f"shutdown failed: {e}"
        log.exception("shutdown failed")
    finally:
        pipe.kill_all()
    say(f"exit codes {res.exit_codes}; accounting {res.accounting}")


# ---------------------------------------------------------------------------- evaluations

def _eval_row(t: float, version: int, scores: dict) -> dict:
    return {"kind": "eval", "time": round(t, 2), "version": version, "heldout_accuracy": scores["accuracy"],
            "heldout_greedy": scores["greedy"], "heldout_pass_at_k": scores.get("pass"),
            "metric": scores["metric"], "eval_seconds": round(scores["seconds"], 2),
            **{f"heldout_{k}": scores[k] for k in ("no_tool", "call_rate") if k in scores}}


def _final_eval(evaluator: VersionEvaluator, rows: list[dict], res: RunResult) -> None:
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
