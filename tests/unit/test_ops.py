"""Deployment material in ops/ and configs/: what can be validated without Docker or a cluster.

- every YAML/JSON file parses; Kubernetes documents are well formed and refer to
  each other consistently (Services -> pods, probes -> ports, volumes -> claims,
  secrets -> keys), and the ConfigMap's rlstream config validates;
- the compose file's services, images, mounts and Prometheus targets agree, and its
  default configuration validates with the compose environment applied;
- alert rules and the Grafana dashboard use only metrics documented in docs/metrics.md;
- `promtool check config`, `check rules` and `test rules` pass (Debian's
  `prometheus` package provides promtool); `systemd-analyze verify` accepts the units.
"""
from __future__ import annotations

import configparser
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from rlstream.common.config import load_config
from tests.support.metrics_docs import parse_metric_table
from tests.support.shipped_manifests import (
    COMPOSE,
    K8S,
    OPS,
    ROOT,
    container,
    find,
    k8s_container_env,
    k8s_docs,
    load_yaml_docs,
    pod_template,
    torchrun_world,
)

ALERTS = OPS / "prometheus" / "alerts.yml"
DASHBOARD = OPS / "grafana" / "dashboards" / "rlstream.json"
PROMTOOL = shutil.which("promtool")
NO_PROMTOOL = "promtool not installed (apt-get install prometheus: Debian's package provides it)"

DATA_FILES = sorted(p for d in (OPS, ROOT / "configs") for p in d.rglob("*")
                    if p.suffix in (".yml", ".yaml", ".json"))


@functools.lru_cache(maxsize=1)
def documented_metrics() -> dict[str, dict]:
    return parse_metric_table((ROOT / "docs" / "metrics.md").read_text())


def trainer_metric_names() -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text().split("rlstream_trainer_step_metric{name=...}`", 1)[1]
    text = text.split("\n## ", 1)[0]
    return {n for line in text.splitlines() if line.startswith("| `") for n in
            re.findall(r"`([a-z_<>]+)`", line.split("|")[1])}


def metric_families(expr: str) -> set[str]:
    """rlstream metric names in a PromQL expression, histogram series mapped to their family."""
    docs = documented_metrics()
    out = set()
    for name in re.findall(r"\brlstream_\w+", expr):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        out.add(name if name in docs or base not in docs or docs[base]["type"] != "histogram" else base)
    return out


# ----------------------------------------------------------------- parsing

def test_ops_and_configs_exist():
    names = {p.relative_to(ROOT).as_posix() for p in DATA_FILES}
    for required in ("ops/compose/docker-compose.yml", "ops/compose/prometheus.yml", "ops/prometheus/alerts.yml",
                     "ops/grafana/dashboards/rlstream.json", "configs/tiny-cpu.yaml"):
        assert required in names
    assert len(list(ROOT.glob("configs/qwen3-30b-a3b-*.yaml"))) >= 4
    for unit in ("broker", "producer", "consumer"):
        assert (OPS / "systemd" / f"rlstream-{unit}.service").is_file()
    assert (OPS / "Dockerfile").is_file() and (OPS / "README.md").is_file()


@pytest.mark.parametrize("path", DATA_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_yaml_and_json_file_parses(path):
    if path.suffix == ".json":
        assert isinstance(json.loads(path.read_text()), dict)
    else:
        docs = load_yaml_docs(path)
        assert docs and all(isinstance(d, dict) for d in docs), f"{path}: expected mapping documents"


# -------------------------------------------------------------- kubernetes

def test_k8s_documents_are_well_formed():
    docs = k8s_docs()
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "ConfigMap", "Secret", "Deployment", "JobSet", "Service",
            "PersistentVolumeClaim", "ServiceMonitor"} <= kinds
    for d in docs:
        assert d.get("apiVersion") and d.get("kind") and d.get("metadata", {}).get("name"), d
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == "rlstream", d["metadata"]["name"]
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kust["resources"]) == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    # `kubectl apply -k ops/k8s` must work without the Prometheus Operator: no ServiceMonitor in the
    # base; the monitoring overlay adds them on top of it
    base = [d for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml" for d in load_yaml_docs(p)]
    assert "ServiceMonitor" not in {d["kind"] for d in base}
    overlay = yaml.safe_load((K8S / "monitoring" / "kustomization.yaml").read_text())
    assert overlay["resources"] == ["..", "servicemonitor.yaml"]


def test_k8s_configmap_holds_a_valid_rlstream_config(tmp_path):
    cm = find("ConfigMap", "rlstream-config")
    f = tmp_path / "rlstream.yaml"
    f.write_text(cm["data"]["rlstream.yaml"])
    cfg = load_config(f, environ={"RLSTREAM__KAFKA__SASL_PLAIN_PASSWORD": "x"})
    assert cfg.kafka.bootstrap_servers and cfg.kafka.security_protocol == "SASL_SSL"
    assert not cfg.model.build_tiny and cfg.producer.http.host == "0.0.0.0"


def _service_args(workload: dict) -> list[str]:
    """The `rlstream` arguments: the container's args, or what follows torchrun's `-m`."""
    c = container(workload)
    if c.get("command") == ["torchrun"]:
        args = c["args"]
        assert args[args.index("-m") + 1] == "rlstream"
        return args[args.index("-m") + 2:]
    return c["args"]


PROBE_PATHS = {"startupProbe": "/healthz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}


def _check_pod(workload: dict, service_cmd: str, http_port: int, rank0_probes: bool = False) -> None:
    spec = pod_template(workload)["spec"]
    c = container(workload)
    assert _service_args(workload)[:3] == [service_cmd, "-c", "/etc/rlstream/rlstream.yaml"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == http_port, "container port must equal the config's http.port"
    for probe, path in PROBE_PATHS.items():  # liveness (progress) and readiness are separate endpoints
        if rank0_probes:  # only rank 0 serves HTTP: the probe asks it on node 0 and passes elsewhere
            command = c[probe]["exec"]["command"][-1]
            assert '[ "$NODE_RANK" != 0 ] ||' in command and f"127.0.0.1:{http_port}{path}'" in command, probe
        else:
            assert c[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    env = {e["name"]: e for e in c["env"]}
    assert env["RLSTREAM_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "admin-token"
    for e in env.values():  # every secret reference points at an existing key
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert ref["key"] in find("Secret", ref["name"])["stringData"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    templates = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
    for m in c["volumeMounts"]:
        assert m["name"] in volumes or m["name"] in templates, m["name"]
    for v in volumes.values():
        if "persistentVolumeClaim" in v:
            find("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
        if "configMap" in v:
            find("ConfigMap", v["configMap"]["name"])
        if "secret" in v:
            find("Secret", v["secret"]["secretName"])
    if workload["kind"] == "Deployment":
        labels = pod_template(workload)["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()


def _mount_of(workload: dict, path: str) -> dict:
    mounts = [m for m in container(workload)["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")
              or path == m["mountPath"]]
    assert mounts, f"nothing mounted at {path}"
    return max(mounts, key=lambda m: len(m["mountPath"]))


def _configmap_config(tmp_path, world_size: int | None = None):
    f = tmp_path / "c.yaml"
    f.write_text(find("ConfigMap", "rlstream-config")["data"]["rlstream.yaml"])
    env = {"RLSTREAM__KAFKA__SASL_PLAIN_PASSWORD": "x"}
    if world_size is not None:
        env["WORLD_SIZE"] = str(world_size)
    return load_config(f, environ=env)


def test_k8s_producer_and_consumer_match_the_config(tmp_path):
    cfg = _configmap_config(tmp_path)
    prod, cons = find("Deployment", "rlstream-producer"), find("JobSet", "rlstream-consumer")
    _check_pod(prod, "producer", cfg.producer.http.port)
    _check_pod(cons, "consumer", cfg.consumer.http.port, rank0_probes=True)
    gpus = container(prod)["resources"]["requests"]["nvidia.com/gpu"]
    assert int(gpus) == cfg.producer.engine.tensor_parallel_size
    # weight store, blobs and checkpoints (every rank writes its shard) on the shared RWX volume
    for path, workloads in ((cfg.consumer.weight_store_dir, (prod, cons)), (cfg.kafka.blob_dir, (prod, cons)),
                            (cfg.consumer.checkpoint_dir, (cons,))):
        for w in workloads:
            vol = {v["name"]: v for v in pod_template(w)["spec"]["volumes"]}[_mount_of(w, path)["name"]]
            pvc = find("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
            assert "ReadWriteMany" in pvc["spec"]["accessModes"], path
    for path in (cfg.model.path, cfg.producer.prompts.path, cfg.kafka.ssl_cafile):
        _mount_of(prod, path)


def test_k8s_consumer_runs_torchrun_with_a_layout_that_fits(tmp_path):
    """The consumer starts under torchrun on every node of one JobSet, with GPUs per pod =
    processes per node, and the ConfigMap's parallel layout validates for that world size
    (the review found a one-process consumer with expert 8: "ep=8 must divide dp=1")."""
    from rlstream.common.errors import ConfigError

    cons = find("JobSet", "rlstream-consumer")
    (rjob,) = cons["spec"]["replicatedJobs"]
    nodes, per_node = torchrun_world(cons)
    job = rjob["template"]["spec"]
    assert rjob["replicas"] == 1 and job["parallelism"] == job["completions"] == nodes
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    assert int(container(cons)["resources"]["requests"]["nvidia.com/gpu"]) == per_node
    args = container(cons)["args"]
    assert "--node_rank=$(NODE_RANK)" in args
    master = next(a for a in args if a.startswith("--master_addr=")).split("=", 1)[1]
    assert master == f"{cons['metadata']['name']}-{rjob['name']}-0-0.{cons['spec']['network']['subdomain']}"
    cfg = _configmap_config(tmp_path, world_size=nodes * per_node)
    assert cfg.consumer.dtype == "bfloat16"
    assert cfg.consumer.parallel.world_size == nodes * per_node  # what the memory check assumes
    with pytest.raises(ConfigError, match="consumer.parallel"):
        _configmap_config(tmp_path, world_size=per_node // 2)  # the same layout on too few ranks is refused


def test_k8s_services_and_servicemonitor_select_the_pods():
    services = [d for d in k8s_docs() if d["kind"] == "Service"]
    pods = {d["metadata"]["name"]: d for d in k8s_docs() if d["kind"] in ("Deployment", "JobSet")}

    def labels(w: dict) -> dict:  # an Indexed Job's pods also carry their completion index
        extra = {"batch.kubernetes.io/job-completion-index": "0"} if w["kind"] == "JobSet" else {}
        return {**pod_template(w)["metadata"]["labels"], **extra}

    for svc in services:
        matched = [w for w in pods.values() if svc["spec"]["selector"].items() <= labels(w).items()]
        assert matched, f"Service {svc['metadata']['name']} selects no pods"
        for port in svc["spec"]["ports"]:
            assert any(port["targetPort"] == p["name"] for w in matched for p in container(w)["ports"])
    sm = find("ServiceMonitor", "rlstream")
    scraped = []
    for svc in services:
        labels = svc["metadata"].get("labels", {})
        if all(labels.get(e["key"]) in e["values"] for e in sm["spec"]["selector"]["matchExpressions"]):
            scraped.append(svc["metadata"]["name"])
            assert {p["name"] for p in svc["spec"]["ports"]} >= {e["port"] for e in sm["spec"]["endpoints"]}
    # each workload scraped once (job = Service name, as the alert rules expect)
    assert sorted(scraped) == ["rlstream-consumer", "rlstream-producer"]


# ----------------------------------------------------------------- compose

def test_compose_services_images_mounts_and_targets_agree():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"kafka", "producer-0", "consumer", "prometheus", "grafana"} <= set(services)
    rl = {n: s for n, s in services.items() if "rlstream" in s.get("image", "")}
    assert {s["image"] for s in rl.values()} == {"rlstream:0.1.0"}
    for s in rl.values():
        assert (COMPOSE.parent / s["build"]["context"] / s["build"]["dockerfile"]).is_file()
    assert "KRaft" in COMPOSE.read_text() and services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] ==\
        "broker,controller"
    for name, s in services.items():
        deps = s.get("depends_on", [])
        assert set(deps) <= set(services), f"{name} depends on an unknown service"
        for vol in s.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (COMPOSE.parent / src).exists(), f"{name}: {src} does not exist"
            else:
                assert src in compose["volumes"], f"{name}: undeclared volume {src}"
    gpus = [d for s in rl.values() for r in [s.get("deploy", {}).get("resources", {}).get("reservations", {})]
            for dev in r.get("devices", []) for d in dev["device_ids"]]
    assert len(gpus) == len(set(gpus)), "two services reserve the same GPU"
    # Prometheus scrapes exactly the producers and the consumer, on their configured ports
    prom = yaml.safe_load((COMPOSE.parent / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] if job["job_name"].startswith("rlstream-")
               for sc in job["static_configs"] for t in sc["targets"]}
    want = set()
    for name, s in rl.items():
        env = s["environment"]
        cmd = " ".join(s["command"])
        if "rlstream producer" in cmd:
            want.add(f"{name}:{env['RLSTREAM__PRODUCER__HTTP__PORT']}")
        elif "rlstream consumer" in cmd:
            want.add(f"{name}:{env['RLSTREAM__CONSUMER__HTTP__PORT']}")
    assert targets == want
    ids = [s["environment"].get("RLSTREAM__PRODUCER__PRODUCER_ID") for s in rl.values()
           if "rlstream producer" in " ".join(s["command"])]
    assert len(ids) == len(set(ids)) and None not in ids


def test_compose_default_config_validates_with_the_compose_environment():
    env = yaml.safe_load(COMPOSE.read_text())["services"]["consumer"]["environment"]
    default = re.fullmatch(r"\$\{RLSTREAM_CONFIG:-/etc/rlstream/configs/(.+)\}", env["RLSTREAM_CONFIG"]).group(1)
    environ = {k: str(v) for k, v in env.items() if k.startswith("RLSTREAM__")}
    cfg = load_config(ROOT / "configs" / default, environ=environ)
    assert cfg.kafka.bootstrap_servers == "kafka:9092" and cfg.consumer.http.host == "0.0.0.0"


def test_grafana_provisioning_matches_the_dashboard():
    compose = yaml.safe_load(COMPOSE.read_text())
    ds = yaml.safe_load((OPS / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    prov = yaml.safe_load((OPS / "grafana/provisioning/dashboards/rlstream.yml").read_text())["providers"]
    mounts = dict(v.split(":")[:2][::-1] for v in compose["services"]["grafana"]["volumes"])
    assert prov[0]["options"]["path"] in mounts and mounts[prov[0]["options"]["path"]] == "../grafana/dashboards"
    dash = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p["targets"]}
    assert uids == {ds[0]["uid"]}


# ------------------------------------------------- metrics in rules/dashboard

def test_alert_rules_and_dashboard_use_documented_metrics():
    docs = documented_metrics()
    trainer_names = trainer_metric_names()
    exprs = [r["expr"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    exprs += [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    tests = yaml.safe_load((OPS / "prometheus" / "alerts_test.yml").read_text())
    exprs += [s["series"] for t in tests["tests"] for s in t["input_series"]]
    for expr in exprs:
        names = metric_families(expr)
        assert names or re.search(r"\bup\b", expr), f"no rlstream metric in {expr!r}"
        unknown = names - set(docs)
        assert not unknown, f"{expr!r} uses undocumented metrics {unknown}"
        for step_name in re.findall(r'rlstream_trainer_step_metric\{[^}]*name="(\w+)"', expr):
            assert step_name in trainer_names, f"trainer metric name={step_name!r} is not emitted"


def test_required_alerts_and_panels_exist():
    alerts = {r["alert"]: r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    for name in ("RlstreamConsumerLagHigh", "RlstreamVersionNotAdvancing", "RlstreamDLQRate",
                 "RlstreamWeightReloadFailures", "RlstreamKLSpike", "RlstreamStalenessAutoAtMin"):
        assert name in alerts
    for a in alerts.values():
        assert a["labels"]["severity"] in ("info", "warning", "critical") and a["annotations"]["summary"]
    titles = " | ".join(p["title"].lower() for p in json.loads(DASHBOARD.read_text())["panels"])
    for word in ("throughput", "staleness", "kl", "reward", "lag", "version"):
        assert word in titles, f"dashboard has no {word} panel"


# ------------------------------------------------------------------ systemd

UNITS = sorted((OPS / "systemd").glob("*.service"))


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_unit(unit, tmp_path):
    from rlstream.cli import SERVICES

    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str
    cp.read_string(unit.read_text())
    assert {"Unit", "Service", "Install"} <= set(cp.sections())
    exec_start = cp["Service"]["ExecStart"].split()
    if exec_start[0].endswith("/torchrun"):  # the consumer: `torchrun ... -m rlstream consumer -c` (test_ops_cluster.py)
        assert exec_start[exec_start.index("-m") + 1] == "rlstream"
        exec_start = [exec_start[0], *exec_start[exec_start.index("-m") + 2:]]
    else:
        assert exec_start[0].endswith("/rlstream")
    assert exec_start[1] in SERVICES and exec_start[2] == "-c"
    assert unit.name == f"rlstream-{exec_start[1]}.service"
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze not installed")
    # verify with ExecStart pointing at this checkout's installed entry point
    local = tmp_path / unit.name
    local.write_text(unit.read_text().replace(exec_start[0], str(ROOT / ".venv" / "bin" / Path(exec_start[0]).name)))
    r = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True, timeout=30)
    problems = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert not problems, problems


# ----------------------------------------------------------------- promtool

def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_promtool_check_rules():
    r = _promtool("check", "rules", str(ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_promtool_alert_unit_tests():
    r = _promtool("test", "rules", str(OPS / "prometheus" / "alerts_test.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
@pytest.mark.parametrize("config", ["ops/compose/prometheus.yml", "ops/prometheus/k8s-scrape.yml"])
def test_promtool_check_config(config):
    r = _promtool("check", "config", config)
    out = r.stdout + r.stderr
    if r.returncode and "kubernetes_sd_configs not found" in out:
        pytest.skip("this promtool build has no Kubernetes service discovery (Debian's prometheus package "
                    "strips it); upstream Prometheus accepts the file")
    assert r.returncode == 0, out
    assert "rule files found" in out and "SUCCESS" in out


def test_dockerfile_builds_the_gpu_image():
    text = (OPS / "Dockerfile").read_text()
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}", text, re.M) and "nvidia/cuda:" in text
    assert 'pip install ".[gpu,tasks]"' in text and 'ENTRYPOINT ["rlstream"]' in text
    assert "python3.11" in text  # pyproject: requires-python >=3.11,<3.12


def test_the_image_copies_every_folder_the_package_is_built_from_before_it_installs():
    """pyproject maps rlstream onto ops/, common/, producer/ and consumer/: `pip install .`
    without one of them builds a package that fails at import."""
    import tomllib

    text = (OPS / "Dockerfile").read_text()
    before_install = text[:text.index('RUN pip install ".[gpu,tasks]"')]
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    copied = set(re.findall(r"^COPY (\w+)/ \1/$", before_install, re.M))
    assert set(folders) <= copied, sorted(set(folders) - copied)


def test_the_image_has_verbs_wherever_a_manifest_asks_for_rdma():
    """NCCL's IB transport dlopens libibverbs and silently falls back to sockets without it: a
    manifest that requests an rdma/ device or enables NCCL's IB needs it (and the mlx5 provider)
    in the image, or the RDMA settings do nothing."""
    wants_rdma = [d["metadata"]["name"] for d in k8s_docs() if d["kind"] in ("Deployment", "JobSet")
                  if any(k.startswith("rdma/") for k in container(d).get("resources", {}).get("requests", {}))
                  or k8s_container_env(d).get("NCCL_IB_DISABLE") == "0"]
    assert wants_rdma, "no manifest asks for RDMA: drop this test"
    apt = " ".join(re.findall(r"apt-get install[^&]*", (OPS / "Dockerfile").read_text().replace("\\\n", " ")))
    for package in ("libibverbs1", "ibverbs-providers"):
        assert package in apt, f"{wants_rdma} ask for RDMA but the image installs no {package}"


def test_dockerfile_cuda_base_matches_the_pinned_torch_build():
    """The image's CUDA is the one the pinned torch wheel was built for (the review found a
    CUDA 12.8 base under a CUDA 13 torch), and the image's doctor refuses a CPU-only torch."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_cuda = pyproject["tool"]["rlstream"]["torch_cuda"]
    assert "torch==2.13.0" in pyproject["project"]["dependencies"]
    text = (OPS / "Dockerfile").read_text()
    image = re.search(r"^ARG CUDA_IMAGE=(\S+)", text, re.M).group(1)
    m = re.fullmatch(r"nvidia/cuda:(\d+\.\d+)\.\d+-[a-z-]*runtime-ubuntu22\.04", image)
    assert m, image
    assert m.group(1) == torch_cuda, f"base image CUDA {m.group(1)} != torch's CUDA {torch_cuda}"
    assert "rlstream.doctor --gpu" in text


def test_doctor_refuses_a_cpu_torch_for_gpu_installs(monkeypatch):
    import torch

    from rlstream import doctor

    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU-only" in doctor.check_cuda_torch()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert doctor.check_cuda_torch() is None
