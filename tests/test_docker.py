"""The docker/ files, checked without a docker engine: compose parses, every command is one the CLI accepts,
the bootstrap's fixed identity gives the multiaddr the others dial, and the dashboard plots real metrics."""

import json
import re
from pathlib import Path

import click
import pytest
import yaml

from spes_node.cli import main
from spes_node.config import list_presets
from spes_node.daemon.metrics import NodeMetrics
from spes_node.daemon.node import SHUTDOWN_S
from spes_node.swarm.identity import peer_id_of

DOCKER = Path(__file__).resolve().parent.parent / "docker"
SPES_SERVICES = ("bootstrap", "volunteer", "status")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _interpolate(value: str) -> str:
    """Compose's `${NAME:-default}` with nothing set in the environment."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def _parse(service: dict, monkeypatch) -> click.Context:
    """The context click builds for the service's command, with the service's environment applied."""
    for name, value in (service.get("environment") or {}).items():
        monkeypatch.setenv(name, _interpolate(str(value)))
    program, name, *args = service["command"]
    assert program == "spes-node"
    with click.Context(main) as parent:
        command = main.get_command(parent, name)
        assert command is not None, f"unknown command {name}"
        return command.make_context(name, list(args), parent=parent)


def _p2p(maddr: str) -> str:
    return maddr.rsplit("/p2p/", 1)[1]


def test_compose_has_the_swarm_services(compose):
    services = compose["services"]
    assert set(SPES_SERVICES) <= set(services)
    assert services["volunteer"]["deploy"]["replicas"] >= 2
    assert "ports" not in services["volunteer"], "fixed host ports would break --scale volunteer=N"
    # docker's default grace of 10 s would SIGKILL a stopping node before its final checkpoint and withdrawal
    grace = services["volunteer"]["stop_grace_period"]
    assert grace.endswith("m") and int(grace[:-1]) * 60 >= 6 * SHUTDOWN_S, grace
    for name in SPES_SERVICES:
        assert services[name]["image"] == "spes-node:latest"
        assert services[name]["build"]["dockerfile"] == "docker/Dockerfile"


@pytest.mark.parametrize("name", SPES_SERVICES)
def test_service_command_is_accepted_by_the_cli(compose, name, monkeypatch):
    ctx = _parse(compose["services"][name], monkeypatch)
    if name == "volunteer":
        assert ctx.params["preset"] in list_presets()
        assert ctx.params["run_id"] == "demo" and ctx.params["device"] == "auto"
    if name == "status":
        assert ctx.params["run_id"] == "demo" and ctx.params["watch"]


def test_a_bad_command_is_rejected(compose, monkeypatch):
    service = dict(compose["services"]["volunteer"])
    service["command"] = [*service["command"], "--metrics-port", "many"]
    with pytest.raises(click.BadParameter):
        _parse(service, monkeypatch)


def test_bootstrap_identity_gives_the_multiaddr_the_others_dial(compose, monkeypatch):
    services = compose["services"]
    bootstrap = _parse(services["bootstrap"], monkeypatch)
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in services["bootstrap"]["volumes"]}
    key = DOCKER / mounts[bootstrap.params["identity"]]
    peer_id = peer_id_of(key).to_base58()
    (listen,) = bootstrap.params["host_maddrs"]
    port = listen.split("/tcp/")[1]
    for name in ("volunteer", "status"):
        (maddr,) = _parse(services[name], monkeypatch).params["peers"]
        assert maddr == f"/dns4/bootstrap/tcp/{port}/p2p/{peer_id}", name


def test_prometheus_scrapes_every_volunteer_on_its_metrics_port(compose, monkeypatch):
    metrics_port = _parse(compose["services"]["volunteer"], monkeypatch).params["metrics_port"]
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    (discovery,) = config["scrape_configs"][0]["dns_sd_configs"]
    assert discovery["names"] == ["volunteer"] and discovery["port"] == metrics_port


def test_monitoring_mounts_exist(compose):
    for name in ("prometheus", "grafana"):
        for volume in compose["services"][name]["volumes"]:
            assert (DOCKER / volume.split(":")[0]).is_file(), volume


def test_dashboard_plots_metrics_that_nodes_export():
    dashboard = json.loads((DOCKER / "grafana-dashboard.json").read_text())
    exported = set(re.findall(r"^(\w+?)(?:\{| )", NodeMetrics(None).render().decode(), flags=re.M))
    used = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used |= set(re.findall(r"\b((?:spes|process)_\w+)", target["expr"]))
    assert used and used <= exported, used - exported
    assert {"spes_bytes_received_total", "spes_bytes_sent_total", "spes_group_size"} <= used
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_dockerfile_builds_cpu_by_default_and_cuda_by_argument():
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^ARG VARIANT=cpu$", text, flags=re.M)
    stages = dict(re.findall(r"^FROM (\S+) AS (\S+)$", text, flags=re.M))
    assert stages.get("python:3.11-slim") == "base-cpu"
    assert "base-cuda" in stages.values()
    assert re.search(r"^FROM base-\$\{VARIANT\}$", text, flags=re.M)
