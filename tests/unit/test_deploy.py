"""docker/ and deploy/k8s/, checked offline (no container runtime or cluster here): the Dockerfile is hadolint-clean
and copies what exists, its command is one our launcher takes; the manifests validate against Kubernetes' own schemas;
the compose file, nginx and Prometheus name the same servers and ports; probes and the autoscaler point at real
things."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER, K8S = ROOT / "docker", ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.31.0"
TRITON_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}


def manifests() -> dict[str, dict]:
    return {doc["kind"]: doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())}


def test_the_dockerfile_is_hadolint_clean():
    run = subprocess.run([str(Path(sys.executable).parent / "hadolint"), str(DOCKER / "Dockerfile")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_dockerfile_copies_what_exists_and_runs_our_launcher():
    from backends.server import arguments

    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    assert re.search(r"^FROM nvcr\.io/nvidia/tritonserver:24\.10-py3$", text, re.M)  # Triton 2.51, as we test
    copied = [src for line in re.findall(r"^COPY (.+)$", text, re.M) for src in shlex.split(line)[:-1]]
    assert copied and all((ROOT / src).exists() for src in copied), copied
    assert "bash scripts/setup.sh" in text  # the same setup as `make setup`
    command = yaml.safe_load(re.search(r"^CMD (.+)$", text, re.M).group(1))  # exec form: a JSON (YAML) list
    assert command[:3] == [".venv/bin/python", "-m", "backends.server"]
    options = arguments().parse_args(command[3:])  # the launcher takes these options (argparse exits if not)
    assert (options.repository, options.log_file) == ("/models", "/dev/stdout")
    assert set(map(int, re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split())) == set(TRITON_PORTS.values())


@pytest.mark.parametrize("path", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_manifests_validate_against_the_kubernetes_schemas(path):
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_manifest_with_an_unknown_field_is_refused():  # the check above can fail
    deployment = manifests()["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_probes_service_budget_and_autoscaler_point_at_the_deployment():
    docs = manifests()
    deployment, service = docs["Deployment"], docs["Service"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == TRITON_PORTS and container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe, path in (("startupProbe", "/v2/health/ready"), ("livenessProbe", "/v2/health/live")):
        assert container[probe]["httpGet"] == {"path": path, "port": "http"}
    command = container["readinessProbe"]["exec"]["command"]  # the deep check, through our probe CLI
    assert command[:3] == [".venv/bin/python", "-m", "client.health"]
    from client.health import main  # noqa: F401 (the module the probe runs exists)
    url = command[command.index("--url") + 1]
    assert url.endswith(f":{TRITON_PORTS['http']}")
    assert service["spec"]["selector"] == labels == docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    target = docs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])


def test_compose_nginx_and_prometheus_name_the_same_servers():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    servers = sorted(name for name, service in compose["services"].items() if "build" in service)
    assert len(servers) == 2
    for service in compose["services"].values():  # bind-mounted config files exist beside the compose file
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith("../model_repository") or (DOCKER / source).is_file(), source
    nginx = (DOCKER / "nginx.conf").read_text()
    for upstream, port in (("triton_http", TRITON_PORTS["http"]), ("triton_grpc", TRITON_PORTS["grpc"])):
        block = re.search(r"upstream %s \{(.*?)\}" % upstream, nginx, re.S).group(1)
        assert sorted(re.findall(r"server ([\w-]+):%d " % port, block)) == servers
    targets = yaml.safe_load((DOCKER / "prometheus.yml").read_text())["scrape_configs"][0]["static_configs"][0]
    assert sorted(targets["targets"]) == [f"{s}:{TRITON_PORTS['metrics']}" for s in servers]
