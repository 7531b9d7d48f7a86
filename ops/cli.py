"""`rlstream` command line: one entry point, one subcommand per service.

    rlstream broker   -c configs/tiny-cpu.yaml      # embedded Kafka-compatible broker
    rlstream producer -c configs/tiny-cpu.yaml      # vLLM rollout service
    rlstream consumer -c configs/tiny-cpu.yaml      # Megatron trainer service
    rlstream demo     -c configs/tiny-cpu.yaml      # everything, end to end, on CPU
    rlstream ctl get|set KEY [VALUE] --url URL      # runtime control client
    rlstream build-model -c configs/tiny-cpu.yaml   # the tiny MoE + tokenizer + task data
    rlstream twin up|down|exec ...                  # a cluster twin on this machine (network namespaces)
    rlstream replay|export|blobs -c ...             # tools on the rollout log (TOOLS; docs/log.md)

Every subcommand validates its configuration (defaults < file < declared
RLSTREAM_* aliases < RLSTREAM__SECTION__KEY < --set < dedicated flags; see
common/config/) before it imports vLLM or Megatron, so a typo fails in a
second; `--dry-run` prints the resolved configuration (secrets masked) and
exits. `--log-level` (env RLSTREAM_LOG_LEVEL) is `cli.log_level`; `ctl --url`
and `--token` (env RLSTREAM_ADMIN_URL, RLSTREAM_ADMIN_TOKEN) are
`cli.admin_url` and `cli.admin_token`.

The producer and consumer write every thread's Python stack to stderr on
SIGUSR1 and go on (`kill -USR1 PID`, common/stacks.py): what a service that
looks stuck is doing, without a debugger.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from rlstream.cluster.cli import add_parser as add_twin_parser
from rlstream.cluster.cli import run_twin
from rlstream.common import gpu_standin
from rlstream.common.config import RlstreamConfig, dump_config, load_config
from rlstream.common.control.ctl import run_ctl
from rlstream.common.errors import RlstreamError
from rlstream.common.kafka.broker import run_broker_forever
from rlstream.common.stacks import dump_stacks_on_sigusr1
from rlstream.consumer.train.memory_check import check_config
from rlstream.harness.experiments import run_experiment
from rlstream.toy.build import ensure_data, ensure_model, wait_for_model

SERVICES = {
    # subcommand -> (module with main(cfg) -> int, one-line help)
    "broker": ("rlstream.cli", "start the bundled tansu broker on loopback"),
    "producer": ("rlstream.producer.service", "run the vLLM rollout producer service"),
    "consumer": ("rlstream.consumer.service", "run the Megatron trainer (consumer) service"),
    "demo": ("rlstream.harness.demo", "run the whole pipeline end to end on CPU"),
    "build-model": ("rlstream.toy.build", "build the tiny MoE model, tokenizer and task data"),
}

TOOLS = {
    # subcommand -> (module with add_arguments(parser) and main(cfg, args) -> int, one-line help)
    "replay": ("rlstream.consumer.logreplay.cli", "train a run again from its log and compare it with the original"),
    "export": ("rlstream.common.export.cli", "write a rollouts topic to Parquet files (resumable)"),
    "blobs": ("rlstream.blobs", "garbage-collect the claim-check blob store (blobs gc)"),
}


def prepare_toy_world(command: str, cfg: RlstreamConfig) -> None:
    """The self-contained toy world (ops/toy/): with `model.build_tiny`, build
    the tiny MoE at `model.path` if it is missing, and for a producer write the
    arithmetic task if its prompts file is missing. Services never do this
    themselves: on a real cluster they load what the config names. Consumer
    ranks > 0 (torchrun) wait for rank 0's build."""
    if command not in ("producer", "consumer") or not cfg.model.build_tiny:
        return

    if command == "consumer" and int(os.environ.get("RANK", "0")) != 0:
        wait_for_model(cfg)
        return
    ensure_model(cfg)
    if command == "producer" and cfg.producer.prompts.type == "jsonl":
        ensure_data(cfg)


def run_broker(cfg: RlstreamConfig) -> int:
    """`rlstream broker`: the bundled tansu broker until SIGTERM/SIGINT."""
    return run_broker_forever(cfg.broker, cfg.kafka)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlstream", description=__doc__.split("\n\n")[0])
    p.add_argument("--log-level", help="setting cli.log_level (env RLSTREAM_LOG_LEVEL; default INFO)")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (module, help_) in {**SERVICES, **TOOLS}.items():
        s = sub.add_parser(name, help=help_)
        if name in TOOLS:
            importlib.import_module(module).add_arguments(s)
        s.add_argument("-c", "--config", help="YAML file (see configs/)")
        s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override one setting, e.g. --set staleness.max_staleness=4")
        s.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    ctl = sub.add_parser("ctl", help="read or change runtime settings through a service's admin API")
    ctl.add_argument("action", choices=["get", "set"])
    ctl.add_argument("key", nargs="?")
    ctl.add_argument("value", nargs="?")
    ctl.add_argument("--url", help="a service's HTTP address: setting cli.admin_url (env RLSTREAM_ADMIN_URL; "
                                    "default http://127.0.0.1:8081)")
    ctl.add_argument("--token", help="admin bearer token: setting cli.admin_token (env RLSTREAM_ADMIN_TOKEN)")
    ctl.add_argument("-c", "--config", help="YAML file to take cli.admin_url / cli.admin_token from")
    exp = sub.add_parser("experiment", help="run a side-by-side experiment (async, objectives, replay, "
                                            "dynamic_sampling, tool_use, stability)")
    exp.add_argument("name", choices=["async", "objectives", "replay", "dynamic_sampling", "tool_use", "stability"])
    exp.add_argument("-c", "--config", default="configs/tiny-cpu.yaml")
    exp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    add_twin_parser(sub)
    return p


def _flags(args: argparse.Namespace) -> dict[str, str | None]:
    """The dedicated flags as settings (the top of the precedence order)."""
    return {"cli.log_level": args.log_level, "cli.admin_url": getattr(args, "url", None),
            "cli.admin_token": getattr(args, "token", None)}


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("kafka", "vllm", "urllib3", "filelock"):  # their INFO is per-connection chatter
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def _print_memory_check(cfg: RlstreamConfig) -> None:
    """The per-GPU memory estimate of consumer/train/memory_check.py, as a YAML comment
    (nothing when consumer.memory.device_memory_gb is unset); a layout that cannot fit
    is refused here as at start (ConfigError)."""
    check = check_config(cfg, os.environ)
    if check is not None:
        print(check.report())
        check.refuse()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "twin":  # no configuration: it builds hosts, not services
        return run_twin(args)
    try:
        cfg = load_config(args.config, getattr(args, "set", []), flags=_flags(args))
        _configure_logging(cfg.cli.log_level)
        if args.command == "ctl":
            return run_ctl(args.action, args.key, args.value, cfg.cli.admin_url, cfg.cli.admin_token)
        if getattr(args, "dry_run", False):
            print(dump_config(cfg), end="")
            if args.command == "consumer":
                _print_memory_check(cfg)
            return 0
        if args.command in TOOLS:
            return int(importlib.import_module(TOOLS[args.command][0]).main(cfg, args))
        if args.command == "experiment":
            return run_experiment(args.name, cfg)
        if args.command in ("producer", "consumer"):
            dump_stacks_on_sigusr1()  # before the threads the service starts
        prepare_toy_world(args.command, cfg)
        gpu_standin.install_if_requested()  # RLSTREAM_GPU_STANDIN: tests and the twin only
        if args.command == "broker":
            return run_broker(cfg)
        module = importlib.import_module(SERVICES[args.command][0])
        return int(module.main(cfg) or 0)
    except RlstreamError as e:
        print(f"rlstream {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
