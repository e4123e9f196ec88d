import math
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from spes_node.daemon.metrics import BYTE_KINDS, PHASES, NodeMetrics
from spes_node.daemon.node import NodeStatus


def _report(round_: int, **overrides) -> dict:
    report = {
        "round": round_,
        "loss": 4.25,
        "shared_group": 3,
        "shard_group": 2,
        "bytes_shared": 1000,
        "bytes_shard": 500,
        "seconds": 2.5,
        "errors": [],
    }
    return {**report, **overrides}


def _status() -> NodeStatus:
    status = NodeStatus(state="training", round=3, tokens=12_000, tokens_per_s=640.0, loss=4.5)
    status.add_bytes("shared", 300, 700)
    status.add_bytes("refresh", 0, 4096)
    return status


def _samples(text: str) -> dict:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return _samples(response.read().decode())


@pytest.fixture
def metrics():
    metrics = NodeMetrics(0, addr="127.0.0.1")
    yield metrics
    metrics.close()


def test_endpoint_serves_the_node_figures(metrics):
    metrics.update(_status(), _report(3), step=30)
    samples = _scrape(metrics.port)
    assert samples[("spes_loss", ())] == 4.5
    assert samples[("spes_round_loss", ())] == 4.25
    assert samples[("spes_tokens_per_second", ())] == 640.0
    assert samples[("spes_round", ())] == 3
    assert samples[("spes_step", ())] == 30
    assert samples[("spes_tokens_total", ())] == 12_000
    assert samples[("spes_state", (("state", "training"),))] == 1
    assert samples[("spes_state", (("state", "averaging"),))] == 0
    assert samples[("spes_group_size", (("group", "shared"),))] == 3
    assert samples[("spes_group_size", (("group", "shard"),))] == 2
    assert samples[("spes_round_duration_seconds", ())] == 2.5
    assert ("process_resident_memory_bytes", ()) in samples


def test_bytes_by_kind_with_every_kind_present(metrics):
    metrics.update(_status(), None)
    samples = _scrape(metrics.port)
    received = {kind: samples[("spes_bytes_received_total", (("kind", kind),))] for kind in BYTE_KINDS}
    sent = {kind: samples[("spes_bytes_sent_total", (("kind", kind),))] for kind in BYTE_KINDS}
    assert received == {"shared": 700, "shard": 0, "refresh": 4096, "state_download": 0}
    assert sent == {"shared": 300, "shard": 0, "refresh": 0, "state_download": 0}


def test_a_round_report_counts_once(metrics):
    status = _status()
    metrics.update(status, _report(3, errors=["all-reduce timed out"]))
    metrics.update(status, _report(3, errors=["all-reduce timed out"]))
    metrics.update(status, _report(4, seconds=1.5, errors=["peer left", "shard group failed"]))
    samples = _samples(metrics.render().decode())
    assert samples[("spes_rounds_total", ())] == 2
    assert samples[("spes_round_seconds_total", ())] == 4.0
    assert samples[("spes_averaging_failures_total", ())] == 3
    assert samples[("spes_round_duration_seconds", ())] == 1.5
    # steps trained past H while waiting add up over the rounds counted
    metrics.update(status, _report(5, steps=13, steps_while_waiting=3))
    metrics.update(status, _report(6, steps=12, steps_while_waiting=2))
    samples = _samples(metrics.render().decode())
    assert samples[("spes_steps_while_waiting_total", ())] == 5
    assert samples[("spes_round_steps", ())] == 12
    # the time of the rounds counted, by phase
    metrics.update(
        status, _report(7, phases={"matchmaking": 0.5, "allreduce": 3.0, "after": 0.25}, stalled=1.0)
    )
    metrics.update(
        status, _report(7, phases={"matchmaking": 9.0, "allreduce": 9.0, "after": 9.0}, stalled=9.0)
    )
    metrics.update(
        status, _report(8, phases={"matchmaking": 0.25, "allreduce": 2.0, "after": 0.5}, stalled=0.5)
    )
    samples = _samples(metrics.render().decode())
    phases = {p: samples[("spes_round_phase_seconds_total", (("phase", p),))] for p in PHASES}
    assert phases == {"matchmaking": 0.75, "allreduce": 5.0, "after": 0.75}
    # and the time they held training (a report seen twice counts once)
    assert samples[("spes_round_stalled_seconds_total", ())] == 1.5


def test_unknown_values_before_the_first_step():
    metrics = NodeMetrics(None)
    assert metrics.port is None
    metrics.update(NodeStatus(), None)
    samples = _samples(metrics.render().decode())
    assert math.isnan(samples[("spes_loss", ())]) and math.isnan(samples[("spes_round_loss", ())])
    assert samples[("spes_state", (("state", "joining"),))] == 1
    assert samples[("spes_rounds_total", ())] == 0


def test_registry_is_private():
    first, second = NodeMetrics(None), NodeMetrics(None)
    status = _status()
    first.update(status, None, step=7)
    assert _samples(first.render().decode())[("spes_step", ())] == 7
    assert _samples(second.render().decode())[("spes_step", ())] == 0


def test_port_in_use_is_a_user_error(metrics):
    with pytest.raises(ValueError, match=f"--metrics-port: cannot listen on 127.0.0.1:{metrics.port}"):
        NodeMetrics(metrics.port, addr="127.0.0.1")


def test_close_stops_serving():
    metrics = NodeMetrics(0, addr="127.0.0.1")
    port = metrics.port
    _scrape(port)
    metrics.close()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
