"""The Kubernetes manifests in deploy/k8s/, checked against the code they start.

A manifest is text nobody runs in CI, so it rots silently: a renamed flag, a Service whose
selector matches no pod, a probe on a port nothing listens on. Here every document is loaded
with PyYAML and:
- has apiVersion, kind and metadata.name;
- a workload's selector matches its own pod template's labels;
- a pdserve container's command line goes through the real parsers (`pdserve` → `worker` /
  `router` → that process's argparse parser → its config builder), after expanding `$(VAR)`
  the way the kubelet does from the container's env (ConfigMap keys looked up in these very
  manifests, pod fields replaced by sample values), so a flag typo or a bad value fails here;
- the ports the process is told to listen on are declared container ports, and the probes
  hit the HTTP one; the process listens on the wildcard and workers advertise the pod IP;
- every Service selects a pod template carrying its labels, and its target ports exist there;
- workers and routers share one --discovery, which names the etcd Service and its port.
The last tests break a copy of the manifests on purpose, so each check is shown to fail.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.cli.main import BUILTIN
from pdserve.errors import ConfigError, PdserveError
from pdserve.membership.uri import parse_discovery
from pdserve.router import main as router_main
from pdserve.router.config import RouterConfig
from pdserve.worker import main as worker_main
from pdserve.worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "k8s" / "base"
OVERLAYS = ROOT / "deploy" / "k8s" / "overlays"
# Secrets the manifests read (created by hand, docs/deploy.md), with sample values.
SECRETS = {
    ("pdserve-cluster", "secret"): "0123456789abcdef" * 4,
    ("pdserve-keys", "api-key"): "sample-api-key-0123",
    ("pdserve-keys", "admin-key"): "sample-admin-key-0123",
}
# What the kubelet would put in `valueFrom.fieldRef` variables for one pod.
POD_FIELDS = {"status.podIP": "10.12.0.7", "metadata.name": "pdserve-decode-6f9c8d7b5-x2k7q"}
WORKLOADS = ("Deployment", "StatefulSet")
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")

Doc = dict[str, Any]


def load(folder: Path = MANIFESTS) -> list[Doc]:
    """Every document of every manifest file below `folder` (kustomizations aside)."""
    docs: list[Doc] = []
    for path in sorted(folder.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                assert isinstance(doc, dict), f"{path.name}: a document is not a mapping"
                docs.append(doc)
    return docs


def name_of(doc: Doc) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def of_kind(docs: list[Doc], *kinds: str) -> list[Doc]:
    return [d for d in docs if d["kind"] in kinds]


def config_maps(docs: list[Doc]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("data", {}) for d in of_kind(docs, "ConfigMap")}


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def pod_labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def containers(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    """(workload, container) for every container of every workload."""
    for workload in of_kind(docs, *WORKLOADS):
        for container in pod_spec(workload)["containers"]:
            yield workload, container


def port_number(container: Doc, port: int | str) -> int:
    """A probe's or Service's port (number or name) as a declared container port."""
    declared = {p["containerPort"]: p.get("name") for p in container.get("ports", [])}
    for number, name in declared.items():
        if port in (number, name):
            return int(number)
    raise AssertionError(f"container {container['name']}: port {port!r} is not declared")


def probe_ports(container: Doc) -> list[int]:
    """The container port each probe hits."""
    ports = []
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        probe = container.get(kind)
        if probe is None:
            continue
        action = probe.get("httpGet") or probe.get("tcpSocket")
        assert action is not None, f"container {container['name']}: {kind} has no port"
        ports.append(port_number(container, action["port"]))
    return ports


def expand_args(container: Doc, maps: dict[str, dict[str, str]]) -> list[str]:
    """`args` with `$(VAR)` replaced from the container's env, as the kubelet does. An unknown
    variable fails: the kubelet would pass the text `$(VAR)` on unchanged."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            assert (ref["name"], ref["key"]) in SECRETS, var
            env[var["name"]] = SECRETS[(ref["name"], ref["key"])]
        elif "fieldRef" in source:
            field = source["fieldRef"]["fieldPath"]
            assert field in POD_FIELDS, f"env {var['name']}: no sample for pod field {field}"
            env[var["name"]] = POD_FIELDS[field]
        else:
            ref = source["configMapKeyRef"]
            data = maps.get(ref["name"])
            assert data is not None, f"env {var['name']}: no ConfigMap {ref['name']}"
            assert ref["key"] in data, f"env {var['name']}: ConfigMap has no key {ref['key']}"
            env[var["name"]] = str(data[ref["key"]])

    def value(match: re.Match[str]) -> str:
        assert match[1] in env, f"container {container['name']}: $({match[1]}) is not in env"
        return env[match[1]]

    return [_VAR.sub(value, str(arg)) for arg in container.get("args", [])]


def pdserve_command(container: Doc, maps: dict[str, dict[str, str]]) -> tuple[str, list[str]]:
    """("worker" | "router", the process's own argv) through the `pdserve` entry point."""
    command = container.get("command", [])
    assert command[:1] == ["pdserve"], f"{command}: not the pdserve entry point"
    name, *rest = [*command[1:], *expand_args(container, maps)]
    assert name in ("worker", "router"), f"{command}: not `pdserve worker` or `pdserve router`"
    assert BUILTIN[name].module == f"pdserve.{name}.main"
    return name, rest[1:] if rest[:1] == ["--"] else rest


def parse(parser: Any, argv: list[str]) -> Any:
    """argparse's answer, or an AssertionError carrying its error line (not a SystemExit)."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser.parse_args(argv)
    except SystemExit:
        raise AssertionError(f"{argv} refused: {stderr.getvalue().strip()}") from None


def worker_config(argv: list[str]) -> WorkerConfig:
    try:
        return worker_main.build_config(parse(worker_main.build_parser(), argv))
    except ConfigError as exc:
        raise AssertionError(f"{argv}: {exc}") from None


def router_config(argv: list[str]) -> RouterConfig:
    parse(router_main.build_parser(), argv)  # the parser's error line, if any
    try:
        return router_main.config_from_args(argv)
    except PdserveError as exc:  # ConfigError and the mode / recovery parsers' errors
        raise AssertionError(f"{argv}: {exc}") from None


def check_shape(doc: Doc) -> None:
    for key in ("apiVersion", "kind", "metadata"):
        assert key in doc, f"{name_of(doc)}: no {key}"
    assert doc["metadata"].get("name"), f"{name_of(doc)}: no metadata.name"


def check_workload(workload: Doc) -> None:
    selector = workload["spec"]["selector"]["matchLabels"]
    labels = pod_labels(workload)
    assert selector.items() <= labels.items(), f"{name_of(workload)}: selector {selector}"
    for container in pod_spec(workload)["containers"]:
        probe_ports(container)  # every probe names a declared port


def check_pdserve_container(workload: Doc, container: Doc, maps: dict[str, dict[str, str]]) -> str:
    """Parse and check one pdserve process; returns its --discovery."""
    secret = [v for v in container.get("env", []) if v["name"] == "PDSERVE_CLUSTER_SECRET"]
    assert secret and "secretKeyRef" in secret[0].get("valueFrom", {}), (
        f"{name_of(workload)}/{container['name']}: the cluster secret must come from a Secret"
    )
    process, argv = pdserve_command(container, maps)
    component = pod_labels(workload).get("app.kubernetes.io/component", "")
    where = f"{name_of(workload)}/{container['name']}"
    if process == "worker":
        config = worker_config(argv)
        expected_roles = {"prefill": ("prefill",), "decode": ("decode", "both")}.get(component, ())
        assert config.role in expected_roles, f"{where}: role {config.role} in a {component} pod"
        assert config.advertised_host == POD_FIELDS["status.podIP"], f"{where}: not the pod IP"
        listened = [config.port, *([config.kv_port] if config.serves_decode else [])]
        host, discovery = config.host, config.discovery
    else:
        router = router_config(argv)
        listened, host, discovery = [router.port], router.host, router.discovery
    # The kubelet probes from the node and peers connect from other pods: not loopback.
    assert host == "0.0.0.0", f"{where}: --host {host} is unreachable from outside the pod"
    # Port 0 would pick a random port that no probe, Service or peer could know.
    for port in listened:
        assert port != 0 and port_number(container, port) == port, f"{where}: port {port}"
    probes = probe_ports(container)
    assert probes and set(probes) == {listened[0]}, f"{where}: probes {probes}, HTTP {listened[0]}"
    assert discovery is not None, f"{where}: no --discovery"
    return discovery


def check_services(docs: list[Doc]) -> None:
    for service in of_kind(docs, "Service"):
        selector = service["spec"].get("selector")
        assert selector, f"{name_of(service)}: no selector"
        selected = [
            w for w in of_kind(docs, *WORKLOADS) if selector.items() <= pod_labels(w).items()
        ]
        assert selected, f"{name_of(service)}: selector {selector} matches no pod template"
        for workload in selected:
            for port in service["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                assert any(_declares(c, target) for c in pod_spec(workload)["containers"]), (
                    f"{name_of(service)}: {name_of(workload)} has no port {target!r}"
                )


def _declares(container: Doc, port: int | str) -> bool:
    try:
        port_number(container, port)
    except AssertionError:
        return False
    return True


def check_discovery(docs: list[Doc], discoveries: list[str]) -> None:
    """One --discovery for everyone, naming a Service (and its port) that selects etcd."""
    assert discoveries and len(set(discoveries)) == 1, f"different --discovery: {discoveries}"
    endpoint = parse_discovery(discoveries[0])
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    service = services.get(endpoint.host)
    assert service is not None, f"--discovery host {endpoint.host} is no Service here"
    assert endpoint.port in [p["port"] for p in service["spec"]["ports"]], endpoint
    selector = service["spec"]["selector"]
    images = [
        c["image"]
        for w in of_kind(docs, *WORKLOADS)
        if selector.items() <= pod_labels(w).items()
        for c in pod_spec(w)["containers"]
    ]
    assert any("etcd" in image for image in images), f"{endpoint.host} selects {images}"


def check_all(docs: list[Doc]) -> None:
    for doc in docs:
        check_shape(doc)
    maps = config_maps(docs)
    discoveries = []
    processes = []
    for workload in of_kind(docs, *WORKLOADS):
        check_workload(workload)
    for workload, container in containers(docs):
        if container.get("command", [None])[0] == "pdserve":
            discoveries.append(check_pdserve_container(workload, container, maps))
            processes.append(pod_labels(workload)["app.kubernetes.io/component"])
    assert sorted(set(processes)) == ["decode", "prefill", "router"], processes
    check_services(docs)
    check_discovery(docs, discoveries)


@pytest.fixture(autouse=True)
def _built_model(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A router without --model loads the built-in tiny model: point it at the session's copy
    # rather than building one in the home directory.
    monkeypatch.setenv("PDSERVE_CACHE", str(tiny_model_path.parent))


@pytest.fixture
def docs() -> list[Doc]:
    return load()


def test_every_document_has_apiversion_kind_and_name(docs: list[Doc]) -> None:
    for doc in docs:
        check_shape(doc)
    assert {d["kind"] for d in docs} >= {"ConfigMap", "Deployment", "Service", "StatefulSet"}


def test_manifests_agree_with_the_code_and_each_other(docs: list[Doc]) -> None:
    check_all(docs)


def test_workers_and_routers_parse_to_the_expected_configs(docs: list[Doc]) -> None:
    maps = config_maps(docs)
    commands = {
        w["metadata"]["name"]: pdserve_command(c, maps)
        for w, c in containers(docs)
        if c.get("command", [None])[0] == "pdserve"
    }
    prefill = worker_config(commands["pdserve-prefill"][1])
    decode = worker_config(commands["pdserve-decode"][1])
    router = router_config(commands["pdserve-router"][1])
    assert (prefill.role, prefill.serves_decode) == ("prefill", False)
    # role both: the routers can switch to colocated (POST /admin/mode) with no restart.
    assert (decode.role, decode.kv_port) == ("both", 8101)
    assert decode.worker_id == POD_FIELDS["metadata.name"]
    assert decode.membership_ttl_s == int(maps["pdserve-config"]["PDSERVE_MEMBERSHIP_TTL_S"])
    assert (router.mode, router.port, router.workers) == ("disagg", 8000, ())
    transport = maps["pdserve-config"]["PDSERVE_KV_TRANSPORT"]
    assert prefill.kv_transport == decode.kv_transport == transport


def _find(docs: list[Doc], kind: str, name: str) -> Doc:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _container(docs: list[Doc], name: str) -> Doc:
    container: Doc = pod_spec(_find(docs, "Deployment", name))["containers"][0]
    return container


def test_a_flag_typo_fails(docs: list[Doc]) -> None:
    broken = copy.deepcopy(docs)
    args = _container(broken, "pdserve-decode")["args"]
    args[args.index("--kv-port=8101")] = "--kv-prot=8101"
    with pytest.raises(AssertionError, match="kv-prot"):
        check_all(broken)


def test_a_bad_value_from_the_configmap_fails(docs: list[Doc]) -> None:
    broken = copy.deepcopy(docs)
    _find(broken, "ConfigMap", "pdserve-config")["data"]["PDSERVE_DISCOVERY"] = "pdserve-etcd:2379"
    with pytest.raises(AssertionError, match="no scheme"):
        check_all(broken)


def test_an_undefined_variable_fails(docs: list[Doc]) -> None:
    broken = copy.deepcopy(docs)
    args = _container(broken, "pdserve-prefill")["args"]
    args[args.index("--advertise-host=$(POD_IP)")] = "--advertise-host=$(POD_ADDRESS)"
    with pytest.raises(AssertionError, match=r"\$\(POD_ADDRESS\) is not in env"):
        check_all(broken)


def test_a_service_selecting_no_pod_fails(docs: list[Doc]) -> None:
    broken = copy.deepcopy(docs)
    selector = _find(broken, "Service", "pdserve-router")["spec"]["selector"]
    selector["app.kubernetes.io/component"] = "routr"
    with pytest.raises(AssertionError, match="matches no pod template"):
        check_all(broken)


def test_a_probe_on_another_port_fails(docs: list[Doc]) -> None:
    broken = copy.deepcopy(docs)
    _container(broken, "pdserve-decode")["readinessProbe"]["httpGet"]["port"] = "kv"
    with pytest.raises(AssertionError, match="probes"):
        check_all(broken)


def test_a_listening_port_not_declared_fails(docs: list[Doc]) -> None:
    broken = copy.deepcopy(docs)
    args = _container(broken, "pdserve-router")["args"]
    args[args.index("--port=8000")] = "--port=8080"
    with pytest.raises(AssertionError, match="8080"):
        check_all(broken)


# ---- the Kustomize base and overlays, the drain wiring, the image (issue 30 D5) ---------------


def kustomize(folder: Path) -> list[Doc]:
    """`kubectl kustomize folder` (kustomize built into kubectl), parsed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed here: the Kustomize render is not checked")
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]


@pytest.mark.parametrize("folder", [MANIFESTS, OVERLAYS / "gpu"], ids=["base", "gpu"])
def test_the_rendered_kustomizations_pass_every_check(folder: Path) -> None:
    docs = kustomize(folder)
    check_all(docs)
    for workload in of_kind(docs, *WORKLOADS):
        assert pod_labels(workload).get("pdserve.io/revision") == "r1", name_of(workload)
    images = {c["image"] for _, c in containers(docs) if c["name"] != "etcd"}
    assert images == ({"pdserve:0.1.0"} if folder == MANIFESTS else {"pdserve:0.1.0-cuda"})


def test_a_rollout_overlay_adds_workers_of_a_second_revision() -> None:
    docs = kustomize(OVERLAYS / "rollout")
    names = sorted(name_of(d) for d in of_kind(docs, *WORKLOADS))
    assert names == ["Deployment/pdserve-decode-r2", "Deployment/pdserve-prefill-r2"]
    maps = config_maps(load())
    for workload, container in containers(docs):
        assert pod_labels(workload)["pdserve.io/revision"] == "r2"
        assert workload["spec"]["selector"]["matchLabels"]["pdserve.io/revision"] == "r2"
        _, argv = pdserve_command(container, maps)
        assert worker_config(argv).engine.model.path == "/models/r2"


def test_workers_drain_before_they_are_stopped(docs: list[Doc]) -> None:
    """preStop runs `pdserve drain --wait` on the worker's own port, within a grace period
    longer than the drain, and the worker's own drain timeout fits in the hook's wait."""
    maps = config_maps(docs)
    workers = [(w, c) for w, c in containers(docs) if c.get("command") == ["pdserve", "worker"]]
    assert len(workers) == 2
    drain = importlib.import_module(BUILTIN["drain"].module)
    for workload, container in workers:
        hook = container["lifecycle"]["preStop"]["exec"]["command"]
        assert hook[:2] == ["pdserve", "drain"]
        args = parse(drain.build_parser(), hook[2:])
        config = worker_config(pdserve_command(container, maps)[1])
        assert args.url == f"http://127.0.0.1:{config.port}" and args.wait
        assert config.drain_timeout_s < args.timeout_s
        grace = pod_spec(workload)["terminationGracePeriodSeconds"]
        assert grace >= args.timeout_s + 5, name_of(workload)


def test_no_key_or_secret_is_on_a_command_line(docs: list[Doc]) -> None:
    for _, container in containers(docs):
        words = [*container.get("command", []), *map(str, container.get("args", []))]
        assert not any(w.split("=")[0] in ("--api-key", "--admin-key") for w in words)
        assert not any(secret in " ".join(words) for secret in SECRETS.values())
    router = _container(docs, "pdserve-router")
    keys = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in router["env"] if "valueFrom" in v
            and "secretKeyRef" in v["valueFrom"]}  # fmt: skip
    assert keys["PDSERVE_API_KEY"]["name"] == keys["PDSERVE_ADMIN_KEY"]["name"] == "pdserve-keys"


def test_the_dockerfile_builds_the_image_the_manifests_run() -> None:
    """No container daemon here: the Dockerfile is read, its entry point and default command
    go through the real parser, every COPY source exists, torch is pinned as the Makefile pins
    it, and the image runs as a user."""
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    entry = next(json.loads(line.split(None, 1)[1]) for line in lines
                 if line.startswith("ENTRYPOINT"))  # fmt: skip
    command = next(json.loads(line.split(None, 1)[1]) for line in lines if line.startswith("CMD ["))
    assert entry == ["pdserve"] and command[0] in BUILTIN
    up = importlib.import_module(BUILTIN[command[0]].module)
    assert up.config_from_args(parse(up.build_parser(), command[1:])).host == "0.0.0.0"
    for line in lines:
        if line.startswith("COPY"):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), line
    assert "ARG TORCH=2.13.0" in text and "download.pytorch.org/whl/cpu" in text
    assert any(line.startswith("USER ") and "root" not in line for line in lines)
    assert "ARG DEVICE=cpu" in text
