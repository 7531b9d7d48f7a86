"""`rlstream` command line: one entry point, one subcommand per service.

    rlstream broker   -c configs/tiny-cpu.yaml      # embedded Kafka-compatible broker
    rlstream producer -c configs/tiny-cpu.yaml      # vLLM rollout service
    rlstream consumer -c configs/tiny-cpu.yaml      # Megatron trainer service
    rlstream demo     -c configs/tiny-cpu.yaml      # everything, end to end, on CPU
    rlstream ctl get|set KEY [VALUE] --url URL      # runtime control client
    rlstream build-model -c configs/tiny-cpu.yaml   # the tiny MoE + tokenizer + task data

Every subcommand validates its configuration (file < env < --set) before it
imports vLLM or Megatron, so a typo fails in a second; `--dry-run` prints the
resolved configuration and exits.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from common.config import RlstreamConfig, dump_config, load_config
from common.errors import RlstreamError

SERVICES = {
    # subcommand -> (module with main(cfg) -> int, one-line help)
    "broker": ("common.app.cli", "start the bundled tansu broker on loopback"),
    "producer": ("producer.service", "run the vLLM rollout producer service"),
    "consumer": ("consumer.service", "run the Megatron trainer (consumer) service"),
    "demo": ("common.harness.demo", "run the whole pipeline end to end on CPU"),
    "build-model": ("common.toy.build", "build the tiny MoE model, tokenizer and task data"),
}


def prepare_toy_world(command: str, cfg: RlstreamConfig) -> None:
    """The self-contained toy world (common/toy/): with `model.build_tiny`, build
    the tiny MoE at `model.path` if it is missing, and for a producer write the
    arithmetic task if its prompts file is missing. Services never do this
    themselves: on a real cluster they load what the config names. Consumer
    ranks > 0 (torchrun) wait for rank 0's build."""
    if command not in ("producer", "consumer") or not cfg.model.build_tiny:
        return
    from common.toy.build import ensure_data, ensure_model, wait_for_model

    if command == "consumer" and int(os.environ.get("RANK", "0")) != 0:
        wait_for_model(cfg)
        return
    ensure_model(cfg)
    if command == "producer" and cfg.producer.prompts.type == "jsonl":
        ensure_data(cfg)


def run_broker(cfg: RlstreamConfig) -> int:
    """`rlstream broker`: the bundled tansu broker until SIGTERM/SIGINT."""
    from common.kafka.broker import run_broker_forever

    return run_broker_forever(cfg.broker, cfg.kafka)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlstream", description=__doc__.split("\n\n")[0])
    p.add_argument("--log-level", default=os.environ.get("RLSTREAM_LOG_LEVEL", "INFO"))
    sub = p.add_subparsers(dest="command", required=True)
    for name, (_, help_) in SERVICES.items():
        s = sub.add_parser(name, help=help_)
        s.add_argument("-c", "--config", help="YAML file (see configs/)")
        s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override one setting, e.g. --set staleness.max_staleness=4")
        s.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    ctl = sub.add_parser("ctl", help="read or change runtime settings through a service's admin API")
    ctl.add_argument("action", choices=["get", "set"])
    ctl.add_argument("key", nargs="?")
    ctl.add_argument("value", nargs="?")
    ctl.add_argument("--url", default=os.environ.get("RLSTREAM_ADMIN_URL", "http://127.0.0.1:8081"),
                     help="a service's HTTP address (env RLSTREAM_ADMIN_URL)")
    ctl.add_argument("--token", default=os.environ.get("RLSTREAM_ADMIN_TOKEN"),
                     help="admin bearer token (env RLSTREAM_ADMIN_TOKEN)")
    exp = sub.add_parser("experiment", help="run a side-by-side experiment (async, objectives, replay)")
    exp.add_argument("name", choices=["async", "objectives", "replay"])
    exp.add_argument("-c", "--config", default="configs/tiny-cpu.yaml")
    exp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("kafka", "vllm", "urllib3", "filelock"):  # their INFO is per-connection chatter
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        if args.command == "ctl":
            from common.control.ctl import run_ctl
            return run_ctl(args.action, args.key, args.value, args.url, args.token)
        cfg = load_config(args.config, args.set)
        if getattr(args, "dry_run", False):
            print(dump_config(cfg), end="")
            return 0
        if args.command == "experiment":
            from common.harness.experiments import run_experiment
            return run_experiment(args.name, cfg)
        prepare_toy_world(args.command, cfg)
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
