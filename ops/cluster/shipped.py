"""The shipped deployment files, read as their orchestrator would run them.

A rehearsal on the cluster twin must run what users deploy, not a copy of it:
these functions take the commands and environments straight from
ops/compose/docker-compose.yml (merge keys and `${VAR:-default}` interpolation
resolved as Docker Compose does), from the systemd units (ExecStart,
Environment=, EnvironmentFile=) and from the k8s manifests of ops/k8s/ (the
ConfigMap's rlstream.yaml; each workload's container command, args with
`$(VAR)` expansion and env with its fieldRef/secretKeyRef sources; the names
cluster DNS gives its Services and pods), so a test that starts them runs the
same command lines with the same settings.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass
class ShippedService:
    """One service of a shipped deployment file."""

    name: str
    command: list[str]
    environment: dict[str, str] = field(default_factory=dict)
    working_dir: str | None = None


def interpolate(text: str, variables: dict[str, str]) -> str:
    """Compose's interpolation: $$ -> $, ${V}, $V, ${V:-default}, ${V-default},
    ${V:?error} (ValueError when V is unset or empty)."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        value, op, arg = variables.get(name), m.group(2), m.group(3)
        if op in (":-", "-"):
            return value if (value if op == ":-" else value is not None) else arg
        if op in (":?", "?") and not value:
            raise ValueError(f"{name}: {arg}")
        return value or ""
    return _VAR.sub(sub, text)


def compose_services(path: str | Path, variables: dict[str, str]) -> dict[str, ShippedService]:
    """The services of a compose file (those with a `command`), interpolated with `variables`."""
    doc = yaml.safe_load(Path(path).read_text())  # PyYAML resolves anchors and `<<` merge keys
    out = {}
    for name, svc in (doc.get("services") or {}).items():
        if "command" not in svc:
            continue
        cmd = svc["command"]
        argv = [interpolate(str(a), variables) for a in cmd] if isinstance(cmd, list)\
            else shlex.split(interpolate(cmd, variables))
        env = svc.get("environment") or {}
        if isinstance(env, list):
            env = dict(e.split("=", 1) for e in env)
        out[name] = ShippedService(name, argv, {k: interpolate(str(v), variables) for k, v in env.items()},
                                   svc.get("working_dir"))
    return out


def systemd_service(path: str | Path, env_files: dict[str, str] | None = None) -> ShippedService:
    """A systemd unit's ExecStart and environment. `env_files` maps an
    EnvironmentFile= path to its text (the operator's file, which is not shipped)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in Path(path).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    svc = sections.get("Service", {})
    env: dict[str, str] = {}
    for f in svc.get("EnvironmentFile", []):
        text = (env_files or {}).get(f.lstrip("-"))
        if text is None and not f.startswith("-"):
            raise FileNotFoundError(f"{path}: EnvironmentFile {f} is required; pass its text in env_files")
        for line in (text or "").splitlines():
            if "=" in line and not line.lstrip().startswith("#"):
                k, _, v = line.partition("=")
                env[k.strip()] = v.strip().strip('"')
    for assignment in svc.get("Environment", []):
        for kv in shlex.split(assignment):
            k, _, v = kv.partition("=")
            env[k] = v
    exec_start = svc.get("ExecStart", [""])[-1].lstrip("-@+!:")
    argv = [interpolate(a, env) for a in shlex.split(exec_start)]  # systemd expands ${VAR} from the unit's env
    return ShippedService(Path(path).stem, argv, env, (svc.get("WorkingDirectory") or [None])[-1])


# ---------------------------------------------------------------- Kubernetes
_K8S_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
CLUSTER_DOMAIN = "cluster.local"


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of command and args: $(VAR) from the container's env,
    $$ -> $, an undefined $(VAR) left as written."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _K8S_VAR.sub(sub, text)


def k8s_documents(directory: str | Path) -> list[dict]:
    """Every object of the manifests in `directory` (multi-document YAML files)."""
    docs = []
    for path in sorted(Path(directory).glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict) and "kind" in d]
    return docs


def k8s_object(docs: list[dict], kind: str, name: str) -> dict:
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise KeyError(f"no {kind} {name!r} in the manifests")


def k8s_config_text(docs: list[dict], configmap: str = "rlstream-config", key: str = "rlstream.yaml") -> str:
    """The rlstream configuration the pods mount (the ConfigMap's data entry)."""
    return k8s_object(docs, "ConfigMap", configmap)["data"][key]


@dataclass
class K8sPod:
    """One pod of a workload, named as Kubernetes names it."""

    name: str
    """metadata.name (and the hostname, as for JobSet pods with DNS hostnames)."""
    index: int
    """Its completion index (JobSet) or replica number (Deployment)."""
    labels: dict[str, str]
    subdomain: str | None = None


@dataclass
class K8sWorkload:
    """A JobSet's replicated job or a Deployment: its pods and its one container."""

    kind: str
    name: str
    namespace: str
    container: dict
    volumes: list[dict]
    pods: list[K8sPod]


def k8s_jobset(docs: list[dict], name: str) -> K8sWorkload:
    """A JobSet of one replicated job: pods <jobset>-<job>-0-<index> (with network.enableDNSHostnames,
    each resolves as <pod>.<subdomain>); Job pods carry the completion index as a label."""
    js = k8s_object(docs, "JobSet", name)
    (rjob,) = js["spec"]["replicatedJobs"]
    job, pod_tpl = rjob["template"]["spec"], rjob["template"]["spec"]["template"]
    subdomain = (js["spec"].get("network") or {}).get("subdomain", name)
    pods = []
    for r in range(rjob.get("replicas", 1)):
        for i in range(job.get("parallelism", 1)):
            labels = {**(pod_tpl["metadata"].get("labels") or {}), "batch.kubernetes.io/job-completion-index": str(i)}
            pods.append(K8sPod(f"{name}-{rjob['name']}-{r}-{i}", i, labels, subdomain))
    spec = pod_tpl["spec"]
    return K8sWorkload("JobSet", name, js["metadata"].get("namespace", "default"), spec["containers"][0],
                       spec.get("volumes") or [], pods)


def k8s_deployment(docs: list[dict], name: str, replicas: int | None = None) -> K8sWorkload:
    """A Deployment's pods (`replicas` of them, default the manifest's); named <deployment>-<i>
    (a ReplicaSet would add hashes)."""
    d = k8s_object(docs, "Deployment", name)
    n = d["spec"].get("replicas", 1) if replicas is None else replicas
    tpl = d["spec"]["template"]
    pods = [K8sPod(f"{name}-{i}", i, dict(tpl["metadata"].get("labels") or {})) for i in range(n)]
    return K8sWorkload("Deployment", name, d["metadata"].get("namespace", "default"), tpl["spec"]["containers"][0],
                       tpl["spec"].get("volumes") or [], pods)


def k8s_env(container: dict, pod: K8sPod, secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """The container's environment in `pod`: plain values (with $(VAR) of earlier entries),
    fieldRef (metadata.name, the completion-index annotation) and secretKeyRef from
    `secrets` ((secret, key) -> value: the operator's Secret, which is not shipped)."""
    env: dict[str, str] = {}
    for e in container.get("env") or []:
        if "value" in e:
            env[e["name"]] = k8s_expand(str(e["value"]), env)
            continue
        source = e.get("valueFrom") or {}
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            fields = {"metadata.name": pod.name,
                      "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(pod.index)}
            if path not in fields:
                raise ValueError(f"{e['name']}: fieldRef {path} is not known to the rehearsal")
            env[e["name"]] = fields[path]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            if (ref["name"], ref["key"]) not in secrets:
                raise KeyError(f"{e['name']}: Secret {ref['name']} key {ref['key']} is required; pass it in secrets")
            env[e["name"]] = secrets[(ref["name"], ref["key"])]
        else:
            raise ValueError(f"{e['name']}: valueFrom {sorted(source)} is not known to the rehearsal")
    return env


def k8s_service(workload: K8sWorkload, pod: K8sPod, entrypoint: list[str],
                secrets: dict[tuple[str, str], str]) -> ShippedService:
    """The container of `pod` as the kubelet starts it: `command` (else the image's
    ENTRYPOINT, `entrypoint`) + `args`, $(VAR) expanded from its env."""
    c = workload.container
    env = k8s_env(c, pod, secrets)
    argv = [k8s_expand(str(a), env) for a in (c.get("command") or entrypoint) + (c.get("args") or [])]
    return ShippedService(pod.name, argv, env, c.get("workingDir"))


def dockerfile_entrypoint(path: str | Path) -> list[str]:
    """The image's ENTRYPOINT (exec form), which a container without `command` runs."""
    entry = None
    for line in Path(path).read_text().splitlines():
        if line.strip().upper().startswith("ENTRYPOINT"):
            entry = yaml.safe_load(line.strip()[len("ENTRYPOINT"):])
    if not isinstance(entry, list):
        raise ValueError(f"{path}: no ENTRYPOINT in exec form")
    return entry


def service_names(name: str, namespace: str, home: str) -> list[str]:
    """What a pod in namespace `home` can dial to reach Service `name` of `namespace`:
    <svc> (same namespace only), <svc>.<ns>, <svc>.<ns>.svc, <svc>.<ns>.svc.cluster.local."""
    names = [name] if namespace == home else []
    return names + [f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}"]


def pod_names(pod: K8sPod, namespace: str) -> list[str]:
    """A pod's DNS names besides its hostname: <pod>.<subdomain>[.<ns>[.svc[.cluster.local]]]
    where the pod has a subdomain (a JobSet with DNS hostnames), none otherwise."""
    if not pod.subdomain:
        return []
    base = f"{pod.name}.{pod.subdomain}"
    return [base, f"{base}.{namespace}", f"{base}.{namespace}.svc", f"{base}.{namespace}.svc.{CLUSTER_DOMAIN}"]


def service_backends(docs: list[dict], pods: list[K8sPod]) -> dict[str, list[K8sPod]]:
    """Each Service of the manifests and the pods its selector matches (by labels)."""
    out = {}
    for d in docs:
        if d["kind"] != "Service":
            continue
        selector = d["spec"].get("selector") or {}
        out[d["metadata"]["name"]] = [p for p in pods if all(p.labels.get(k) == str(v) for k, v in selector.items())]
    return out


def cluster_dns(docs: list[dict], pods: list[K8sPod], namespace: str) -> dict[str, list[str]]:
    """Each pod's names besides its hostname, as cluster DNS answers them in `namespace`:
    its subdomain names, and every Service that selects it (a Service over several pods
    is given to the first: a hosts file has one address per name, and only Prometheus
    dials such a Service)."""
    names = {p.name: pod_names(p, namespace) for p in pods}
    for svc, backends in service_backends(docs, pods).items():
        if backends:
            names[backends[0].name] += service_names(svc, namespace, namespace)
    return names


def external_service_names(host: str, home: str) -> list[str]:
    """A Service address of another namespace as written (e.g. Kafka's bootstrap
    `rlstream-kafka-bootstrap.kafka.svc`) and the other forms DNS answers it by."""
    svc, _, rest = host.partition(".")
    namespace = rest.split(".")[0] if rest else home
    return list(dict.fromkeys([host, *service_names(svc, namespace, home)]))
