"""Services as child processes: the one supervisor of the demo, the experiments, the tests and the benchmarks.

A `Service` is one `rlstream <command>` (broker, producer or consumer),
started again after every stop or kill: each start is a new incarnation with
its own log, `<log_dir>/<name>.<n>.log`, and, for producers and consumers, its
own run file, `<log_dir>/<name>.<n>.run.json`, passed on the command line
(`--set <command>.run_file=...`, so services sharing one config file never
share a run file). What a supervisor needs to know about a service comes
from that run file (common/runfile.py): its HTTP address once it serves
(`url`, `wait_ready`), its final counters once it stopped cleanly (`final`).
Logs are for people: error messages quote their tail.

Processes come from common/process.py: each incarnation leads its own process
group and dies with its parent; `stop` is graceful (SIGTERM to the service,
SIGKILL to the group after a timeout), `kill` is a crash (SIGKILL to the
group: the service and its workers).

`Pipeline` is one run's processes: the broker (on a free port, ready when it
answers a Kafka request), the consumer, and N producers (each serving HTTP on
a port of its own choosing, ready when its /healthz answers). ops/harness/
runs.py stops them in the order that loses nothing.

Every wait has a timeout and notices a service that died meanwhile
(`wait_until`); failures raise `PipelineError` with the service's log tail.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from rlstream.common import process
from rlstream.common.config import RlstreamConfig
from rlstream.common.errors import PipelineError
from rlstream.common.kafka.broker import free_port, kafka_ping
from rlstream.common.runfile import read_run_file
from rlstream.harness import observe

log = logging.getLogger("rlstream.supervisor")

RUN_FILE_COMMANDS = ("producer", "consumer")
"""Commands that write a run file (their config section has `run_file`)."""


def child_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every service: explicit thread counts, offline, unbuffered.

    RLSTREAM__* variables are removed: the config file and the command line
    are the single source of a service's settings.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM__")}
    env.update({
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1",
    })
    env.update(extra or {})
    return env


def rlstream_argv(command: str, config: Path, sets: Iterable[str] = ()) -> list[str]:
    """`rlstream <command> -c <config> --set ...` with this interpreter."""
    argv = [sys.executable, "-m", "rlstream.cli", command, "-c", str(config)]
    for s in sets:
        argv += ["--set", s]
    return argv


def wait_until(pred: Callable[[], object], timeout_s: float, what: str, services: Iterable["Service"] = (),
               interval_s: float = 0.2, progress: Callable[[], object] | None = None):
    """Poll `pred()` until it is truthy and return that value.

    PipelineError if one of `services` exits meanwhile, or after `timeout_s`. With
    `progress` (a callable whose value changes while the awaited work advances, e.g.
    tests/support/progress.py `working`), `timeout_s` bounds the time without
    progress instead of the whole wait: a loaded machine is slow, not stuck.
    """
    services = list(services)
    mark = progress() if progress is not None else None
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        for s in services:
            if s.started and not s.alive:
                raise PipelineError(f"{s.name} exited ({s.returncode}) while waiting for {what}; "
                                    f"log tail ({s.log_path()}):\n{s.log_tail()}")
        if progress is not None and (now := progress()) != mark:
            mark, deadline = now, time.monotonic() + timeout_s
        if time.monotonic() > deadline:
            tails = "".join(f"\n--- {s.name} ({s.log_path()}):\n{s.log_tail(1500)}" for s in services)
            without = " without progress" if progress is not None else ""
            raise PipelineError(f"timed out after {timeout_s:.0f} s{without} waiting for {what}{tails}")
        time.sleep(interval_s)


class Service:
    """`rlstream <command> -c <config>` as a child process, one incarnation after another."""

    def __init__(self, command: str, config: str | os.PathLike, log_dir: str | os.PathLike, *,
                 name: str | None = None, sets: Iterable[str] = (), env: dict[str, str] | None = None,
                 launch: Callable[[list[str]], list[str]] | None = None, address: str | None = None):
        self.command, self.config, self.log_dir = command, Path(config), Path(log_dir)
        self.name = name or command
        self.sets = list(sets)
        self.env = child_env(1) if env is None else env
        # On another host of a cluster twin (ops/cluster/twin.py): `launch` wraps the argv
        # to run there (ClusterTwin.command), `address` is where this machine reaches it.
        self.launch, self.address = launch, address
        self.proc = None
        self.incarnation = 0

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "Service":
        """A new incarnation (the previous one must have exited)."""
        if self.alive:
            raise PipelineError(f"{self.name} is already running (pid {self.pid})")
        self.incarnation += 1
        self.run_path().unlink(missing_ok=True)
        argv = self.launch(self.argv()) if self.launch else self.argv()
        self.proc = process.spawn(argv, self.log_path(), self.env)
        log.info("started %s #%d (pid %d): %s", self.name, self.incarnation, self.pid,
                 " ".join(self.argv()[2:]))
        return self

    def argv(self) -> list[str]:
        sets = list(self.sets)
        if self.command in RUN_FILE_COMMANDS:
            sets.append(f"{self.command}.run_file={self.run_path()}")
        return rlstream_argv(self.command, self.config, sets)

    @property
    def started(self) -> bool:
        return self.proc is not None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """Exit code of the current incarnation; None while it runs (or before start)."""
        return None if self.proc is None else self.proc.poll()

    def terminate(self) -> None:
        """SIGTERM to the service (it drains or finishes its step, then exits)."""
        if self.proc is not None:
            process.terminate(self.proc)

    def wait(self, timeout_s: float) -> int | None:
        """Exit code after `terminate`; the process group is SIGKILLed after `timeout_s`."""
        if self.proc is None:
            return None
        code, killed = process.wait_or_kill(self.proc, timeout_s)
        if killed:
            log.error("%s (pid %d) ignored SIGTERM for %.0f s: killed its process group",
                      self.name, self.pid, timeout_s)
        return code

    def stop(self, timeout_s: float = 120.0) -> int | None:
        """Graceful stop (`terminate` + `wait`); the exit code."""
        self.terminate()
        return self.wait(timeout_s)

    def kill(self, timeout_s: float = 60.0) -> int | None:
        """A crash: SIGKILL to the whole process group; the exit code (-9 if it was running)."""
        return None if self.proc is None else process.kill_group(self.proc, timeout_s)

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc) -> None:
        if self.alive:
            self.kill()

    # ------------------------------------------------------------ status

    def log_path(self, incarnation: int | None = None) -> Path:
        return self.log_dir / f"{self.name}.{incarnation or self.incarnation}.log"

    def run_path(self, incarnation: int | None = None) -> Path:
        return self.log_dir / f"{self.name}.{incarnation or self.incarnation}.run.json"

    def status(self, incarnation: int | None = None) -> dict | None:
        """What the incarnation last wrote to its run file (None: nothing yet)."""
        return read_run_file(self.run_path(incarnation)) if self.command in RUN_FILE_COMMANDS else None

    def final(self, incarnation: int | None = None) -> dict | None:
        """The stop record (final counters) if the incarnation stopped cleanly, else None."""
        st = self.status(incarnation)
        return st if st is not None and st.get("state") == "stopped" else None

    @property
    def url(self) -> str | None:
        """http://host:port of /metrics, /healthz and the admin API, once it serves."""
        st = self.status()
        url = st.get("http_url") if st else None
        if url and self.address:  # a wildcard bind on another host: reach it at the host's address
            for wildcard in ("//0.0.0.0:", "//[::]:"):
                url = url.replace(wildcard, f"//{self.address}:")
        return url

    def wait_ready(self, timeout_s: float = 240.0, progress: Callable[[], object] | None = None) -> str:
        """The HTTP address, once the run file has it (PipelineError if the service died).
        `progress`: as `wait_until`'s (then `timeout_s` bounds a start that makes no progress)."""
        if self.command not in RUN_FILE_COMMANDS:
            raise PipelineError(f"{self.name}: `rlstream {self.command}` writes no run file to wait for")
        return wait_until(lambda: self.url, timeout_s, f"{self.name} to serve HTTP", [self], progress=progress)

    def log_text(self, incarnation: int | None = None) -> str:
        """The whole log of an incarnation: for people and error messages, not for state."""
        try:
            return self.log_path(incarnation).read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, max_bytes: int = 4000) -> str:
        return process.log_tail(self.log_path(), max_bytes)

    # ------------------------------------------------------------ http

    def get(self, path: str, token: str | None = None, timeout_s: float = 10.0) -> tuple[int, bytes]:
        if self.url is None:
            raise PipelineError(f"{self.name} serves no HTTP yet (no run file at {self.run_path()})")
        return observe.http_request(self.url + path, token=token, timeout=timeout_s)

    def scrape(self) -> str:
        """The /metrics exposition text."""
        code, body = self.get("/metrics")
        if code != 200:
            raise PipelineError(f"{self.name} answered /metrics with HTTP {code}")
        return body.decode()

    def metric(self, metric_name: str, **labels) -> float:
        """Sum of the samples `metric_name` whose labels include `labels` (0 if none)."""
        return observe.metric_value(self.scrape(), metric_name, **labels)

    def try_metric(self, metric_name: str, default: float = math.nan, **labels) -> float:
        """`metric`, or `default` while the service does not answer."""
        try:
            return self.metric(metric_name, **labels)
        except (OSError, PipelineError):
            return default


@dataclass
class Pipeline:
    """Broker + consumer + producers of one run, sharing one config file."""

    cfg: RlstreamConfig
    config: Path
    log_dir: Path
    num_producers: int = 1
    start_timeout_s: float = 240.0
    stop_timeout_s: float = 120.0
    env: dict[str, str] = field(default_factory=dict)
    """Environment every service gets beside child_env's (the run's admin token)."""
    services: list[Service] = field(default_factory=list)
    bootstrap: str = ""

    @property
    def broker(self) -> Service:
        return self.services[0]

    @property
    def producers(self) -> list[Service]:
        return [s for s in self.services if s.command == "producer"]

    @property
    def consumer(self) -> Service | None:
        return next((s for s in self.services if s.command == "consumer"), None)

    def start(self) -> None:
        """Broker first (until it answers Kafka requests), then the consumer and the producers."""
        host, port = self.cfg.broker.host, free_port(self.cfg.broker.host)
        self.bootstrap = f"{host}:{port}"
        broker = self._start("broker", [f"broker.port={port}"], threads=1)
        wait_until(lambda: kafka_ping(host, port, 0.5), 30.0, "the broker to answer", [broker], 0.5)
        kafka = f"kafka.bootstrap_servers={self.bootstrap}"
        self._start("consumer", [kafka, "consumer.http.port=0"], threads=self.cfg.consumer.num_threads)
        ncpu = os.cpu_count() or 1
        for i in range(self.num_producers):
            p = self.cfg.producer
            self._start("producer", [kafka, "producer.http.port=0", f"producer.producer_id=p{i}",
                                     f"producer.prompts.seed={p.prompts.seed + i}", f"producer.engine.seed={p.engine.seed + i}"],
                        threads=p.num_threads, name=f"producer-{i}",
                        extra_env={"VLLM_CPU_OMP_THREADS_BIND": str(i % ncpu)})
        for s in self.services[1:]:
            wait_until(lambda s=s: s.url and observe.healthy(s.url), self.start_timeout_s,
                       f"{s.name} to be healthy", self.services, 0.5)

    def _start(self, command: str, sets: list[str], threads: int, name: str | None = None,
               extra_env: dict[str, str] | None = None) -> Service:
        s = Service(command, self.config, self.log_dir, name=name, sets=sets,
                    env=child_env(threads, {**self.env, **(extra_env or {})}))
        self.services.append(s.start())
        return s

    def check_alive(self) -> None:
        """PipelineError (with the log tail) if any service exited."""
        for s in self.services:
            if s.started and not s.alive:
                raise PipelineError(f"{s.name} exited with code {s.returncode}; log tail "
                                    f"({s.log_path()}):\n{s.log_tail()}")

    def scrape_all(self) -> dict[str, observe.Metrics | None]:
        """One scrape of every service that serves HTTP, by name."""
        return {s.name: observe.scrape(s.url) for s in self.services if s.url}

    def kill_all(self) -> None:
        for s in self.services:
            if s.alive:
                s.kill()
