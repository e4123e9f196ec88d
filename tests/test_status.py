import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import matplotlib.image
import pytest
from click.testing import CliRunner
from PIL import Image
from swarm_utils import NODE_ENV, Swarm, free_port, spes_cli

from spes_node.cli import main
from spes_node.config import config_digest, load_preset
from spes_node.daemon.status import _trusted_config, plot, render, summarize
from spes_node.swarm.records import ConfigInfo, NodeInfo

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NODE_FIELDS = {"peer_id", "shards", "round", "step", "tokens", "tokens_per_s", "loss", "state", "last_seen_s"}
SHARD_FIELDS = {"shard", "experts", "replicas", "holders"}
NOW = 10_000.0


def _config(**swarm) -> ConfigInfo:
    cfg = load_preset("tiny").replace(swarm=swarm) if swarm else load_preset("tiny")
    text = cfg.to_json()
    return ConfigInfo("r", config_digest(text), text, "0.1.0", NOW - 100, NOW + 3000)


def _node(peer_id: str, shards, **fields) -> NodeInfo:
    defaults = dict(state="training", updated_at=NOW - 1, expires_at=NOW + 2)
    return NodeInfo(peer_id=peer_id, shards=list(shards), **{**defaults, **fields})


@pytest.fixture
def swarm_records():
    nodes = {
        "QmAlice111": _node(
            "QmAlice111", [0], round=4, step=40, tokens=40_000, tokens_per_s=1000.0, loss=4.0,
            public_name="alice", loss_history=[5.5, 5.0, 4.5, 4.1], updated_at=NOW - 2.5,
        ),
        "QmBob22222": _node(
            "QmBob22222", [1], round=3, step=30, tokens=30_000, tokens_per_s=500.0, loss=5.0,
            state="averaging", loss_history=[5.4, 5.1],
        ),
        "QmCarol333": _node("QmCarol333", [0], tokens=0, loss=0.0),
        "QmDave4444": _node("QmDave4444", [], state="joining", tokens_per_s=300.0),
    }  # fmt: skip
    return _config(), nodes


def test_summary_has_the_contract_fields(swarm_records):
    config, nodes = swarm_records
    summary = summarize("r", config, nodes, NOW)
    json.dumps(summary, allow_nan=False)
    assert summary["run_id"] == "r"
    assert summary["config_hash"] == config.config_hash
    assert {n["peer_id"] for n in summary["nodes"]} == set(nodes)
    for node in summary["nodes"]:
        assert NODE_FIELDS <= node.keys()
    for shard in summary["shards"]:
        assert SHARD_FIELDS <= shard.keys()
    assert [s["shard"] for s in summary["shards"]] == [0, 1, 2, 3]


def test_summary_shards_holders_and_under_replicated(swarm_records):
    config, nodes = swarm_records
    summary = summarize("r", config, nodes, NOW)
    shards = {s["shard"]: s for s in summary["shards"]}
    assert shards[0]["experts"] == [0, 1] and shards[3]["experts"] == [6, 7]
    assert sorted(shards[0]["holders"]) == ["QmAlice111", "QmCarol333"] and shards[0]["replicas"] == 2
    assert shards[1]["holders"] == ["QmBob22222"] and shards[1]["replicas"] == 1
    assert shards[2]["holders"] == [] and shards[2]["replicas"] == 0
    assert summary["under_replicated"] == [1, 2, 3]
    assert summary["replication_target"] == 2


def test_summary_swarm_totals(swarm_records):
    config, nodes = swarm_records
    summary = summarize("r", config, nodes, NOW)
    assert summary["highest_round"] == 4
    assert summary["total_tokens"] == 70_000
    assert summary["tokens_per_s"] == 1500.0
    assert summary["mean_loss"] == pytest.approx(4.5)
    assert (
        summary["model"]["params_total"]
        > summary["model"]["params_active"]
        > summary["model"]["params_shared"]
    )
    by_id = {n["peer_id"]: n for n in summary["nodes"]}
    assert by_id["QmAlice111"]["last_seen_s"] == pytest.approx(2.5)
    assert by_id["QmCarol333"]["loss"] is None
    assert by_id["QmAlice111"]["loss_history"] == [5.5, 5.0, 4.5, 4.1]


def test_summary_without_config_guesses_shards():
    nodes = {"QmX1": _node("QmX1", [2], loss=3.0), "QmY2": _node("QmY2", [0], loss=3.0)}
    summary = summarize("r", None, nodes, NOW)
    assert summary["config_hash"] is None and summary["model"] is None
    assert [s["replicas"] for s in summary["shards"]] == [1, 0, 1]
    assert summary["under_replicated"] == []
    assert "config unknown" in render(summary)


def test_summary_of_empty_swarm():
    summary = summarize("r", _config(), {}, NOW)
    assert summary["nodes"] == [] and summary["mean_loss"] is None
    assert summary["under_replicated"] == [0, 1, 2, 3]
    assert "(no live nodes)" in render(summary)


def test_trusted_config_is_the_anchored_one_and_conflicts_are_warned():
    honest, other = _config(), _config(sync_steps=7)
    configs = {other.config_hash: other, honest.config_hash: honest}
    warnings: list[str] = []
    assert _trusted_config("r", configs, honest.config_hash, warnings) is honest
    assert len(warnings) == 1 and other.config_hash in warnings[0] and "ignored" in warnings[0]

    warnings.clear()
    assert _trusted_config("r", configs, None, warnings) is None, "two copies against one decide nothing"
    assert honest.config_hash in warnings[0] and other.config_hash in warnings[0]
    assert "--config-hash" in warnings[0]

    warnings.clear()
    assert _trusted_config("r", {honest.config_hash: honest}, None, warnings) is honest and not warnings
    assert _trusted_config("r", {other.config_hash: other}, honest.config_hash, warnings) is None
    assert f"no config with hash {honest.config_hash}" in warnings[0] and other.config_hash in warnings[0]


def test_warnings_are_in_the_json_and_the_table(swarm_records):
    config, nodes = swarm_records
    warnings = [
        "Ignoring node record b'x' of run r: value has 9 bytes",
        "evil \x1b[2J name",
        "evil \x1b[2J name",
    ]
    summary = summarize("r", None, nodes, NOW, warnings, [config.config_hash, "f" * 64])
    json.dumps(summary, allow_nan=False)
    assert summary["warnings"] == warnings[:2], "the same warning once"
    assert summary["config_hash"] is None and summary["config_hashes"] == [config.config_hash, "f" * 64]
    text = render(summary)
    assert "config untrusted (2 published, see warnings)" in text
    assert "WARNING: Ignoring node record" in text and "WARNING: evil ?[2J name" in text
    assert "\x1b" not in text
    assert summarize("r", config, nodes, NOW)["warnings"] == []


def test_render_shows_nodes_and_marks_under_replicated_shards(swarm_records):
    config, nodes = swarm_records
    text = render(summarize("r", config, nodes, NOW))
    assert f"config {config.config_hash[:12]}" in text
    assert "4 nodes  round 4  tokens 70.0k" in text
    assert "mean loss 4.500" in text
    lines = text.splitlines()
    alice = next(line for line in lines if "alice" in line and "training" in line)
    assert alice.split()[:5] == ["Alice111", "alice", "0", "4", "40"]
    shard_lines = {int(line.split()[0]): line for line in lines if re.match(r"^\d\s+\d-\d", line)}
    assert set(shard_lines) == {0, 1, 2, 3}
    assert "UNDER-REPLICATED" not in shard_lines[0]
    assert all("UNDER-REPLICATED (target 2)" in shard_lines[s] for s in (1, 2, 3))
    assert "alice" in shard_lines[0] and "Carol333" in shard_lines[0]


def _assert_png(path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as image:
        image.verify()
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100


def test_plot_writes_a_png(tmp_path, swarm_records):
    config, nodes = swarm_records
    path = tmp_path / "status.png"
    plot(summarize("r", config, nodes, NOW), path)
    _assert_png(path)
    assert [p.name for p in tmp_path.iterdir()] == ["status.png"]


def test_plot_of_empty_swarm(tmp_path):
    path = tmp_path / "empty.png"
    plot(summarize("r", None, {}, NOW), path)
    _assert_png(path)


@pytest.fixture
def cli():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield CliRunner()
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--timeout", "0"], "--timeout: must be positive"),
        (["--interval", "-1"], "--interval: must be positive"),
        (["--plot", "/nonexistent-dir/x.png"], "--plot: directory"),
    ],
)
def test_status_rejects_bad_flags(cli, args, message):
    result = cli.invoke(main, ["status", "--peers", "/ip4/127.0.0.1/tcp/1", *args])
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_status_requires_peers(cli):
    result = cli.invoke(main, ["status"], env={"SPES_PEERS": None})
    assert result.exit_code == 2 and "--peers" in result.stderr


def _assert_one_line_error(result, started: float, *fragments: str) -> None:
    assert time.monotonic() - started < 60
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("spes-node: error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    assert result.stdout == ""


@pytest.mark.swarm
def test_status_of_unreachable_peer_fails_in_one_line():
    maddr = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/QmXZ8oXr4z2dFFU1Ms2mx6kzLb2fkz5o8W3BqzZJvtUNCp"
    started = time.monotonic()
    result = spes_cli("status", "--peers", maddr, "--timeout", "10")
    _assert_one_line_error(result, started, "cannot reach the swarm", maddr)


# ------------------------------------------------------------------------------------- a live swarm
# One swarm for the tests below, in file order: 3 nodes, 2 shards (so one shard has 2 replicas), one node
# serving metrics; the last test kills a node.


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    swarm = Swarm(tmp_path_factory.mktemp("status-swarm"), run_id="watched", num_shards=2)
    yield swarm
    swarm.close()


@pytest.mark.swarm
def test_status_of_unknown_run_id_fails_in_one_line(swarm):
    started = time.monotonic()
    result = spes_cli("status", "--peers", swarm.maddr, "--run-id", "no-such-run", "--timeout", "3")
    _assert_one_line_error(result, started, "no swarm 'no-such-run'")


@pytest.fixture(scope="module")
def live(swarm):
    swarm.metrics_port = free_port()
    for name in ("n0", "n1"):
        swarm.start(name, "--max-rounds", "200")
    swarm.start("n2", "--max-rounds", "200", "--metrics-port", str(swarm.metrics_port))

    def settled():
        nodes = swarm.nodes()
        if len(nodes) != 3 or any(n.state not in ("training", "averaging") for n in nodes.values()):
            return None
        counts = sorted(len([n for n in nodes.values() if s in n.shards]) for s in (0, 1))
        return nodes if counts == [1, 2] else None

    swarm.wait_for(settled, 150, "3 training nodes holding shards 2 + 1")
    return swarm


def _status_json(swarm: Swarm, *args: str) -> dict:
    """`status --json` in this process (a subprocess would spend most of its time importing torch)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        result = CliRunner().invoke(
            main, ["status", "--peers", swarm.maddr, "--run-id", swarm.run_id, "--json", *args]
        )
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.swarm
def test_status_json_lists_live_nodes_with_shards_and_holders(live, tmp_path):
    picture = tmp_path / "live.png"
    summary = _status_json(live, "--plot", str(picture))
    assert summary["run_id"] == "watched"
    assert summary["config_hash"] == live.cfg.hash()
    nodes = {n["public_name"]: n for n in summary["nodes"]}
    assert set(nodes) == {"n0", "n1", "n2"}
    for node in nodes.values():
        assert NODE_FIELDS <= node.keys()
        assert len(node["shards"]) == 1 and node["state"] in ("training", "averaging")
        assert 0 <= node["last_seen_s"] < 5 * live.cfg.swarm.heartbeat_s
    for shard in summary["shards"]:
        holders = sorted(n["peer_id"] for n in nodes.values() if shard["shard"] in n["shards"])
        assert sorted(shard["holders"]) == holders and shard["replicas"] == len(holders)
    assert sorted(s["replicas"] for s in summary["shards"]) == [1, 2]
    assert summary["under_replicated"] == [next(s["shard"] for s in summary["shards"] if s["replicas"] == 1)]
    _assert_png(picture)


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("spes_")
    }


@pytest.mark.swarm
def test_daemon_metrics_count_bytes_by_kind_after_a_round(live):
    def after_a_round_with_traffic():
        try:
            metrics = _scrape(live.metrics_port)
        except OSError:
            return None
        received = {k: v for k, v in metrics.items() if k.startswith("spes_bytes_received_total")}
        return metrics if metrics["spes_rounds_total"] >= 1 and any(received.values()) else None

    metrics = live.wait_for(after_a_round_with_traffic, 120, "a round with traffic on the metrics endpoint")
    for kind in ("shared", "shard", "refresh", "state_download"):
        assert f'spes_bytes_received_total{{kind="{kind}"}}' in metrics
        assert f'spes_bytes_sent_total{{kind="{kind}"}}' in metrics
    assert metrics["spes_round"] >= 1 and metrics["spes_step"] >= live.cfg.swarm.sync_steps
    assert metrics["spes_tokens_total"] > 0
    assert metrics['spes_group_size{group="shared"}'] >= 1


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_watch_prints_fresh_summaries_until_interrupted(live):
    cmd = [sys.executable, "-m", "spes_node.cli", "status", "--peers", live.maddr, "--run-id", live.run_id]
    watch = subprocess.Popen(
        [*cmd, "--watch", "--json", "--interval", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, **NODE_ENV),
    )
    try:
        first, second = json.loads(watch.stdout.readline()), json.loads(watch.stdout.readline())
        assert second["dht_time"] > first["dht_time"]
        assert len(second["nodes"]) == 3
        watch.send_signal(signal.SIGINT)
        assert watch.wait(90) == 0, watch.stderr.read()
    finally:
        watch.kill()
        watch.wait()


@pytest.mark.swarm
def test_killed_node_expires_and_its_shard_becomes_under_replicated(live):
    nodes = live.nodes()
    doubled = next(s for s in (0, 1) if sum(s in n.shards for n in nodes.values()) == 2)
    victim = next(n for n in nodes.values() if doubled in n.shards)
    live.kill(victim.public_name, signal.SIGKILL)
    live.wait_for(
        lambda: victim.peer_id not in live.nodes(), 30, f"the record of {victim.public_name} to expire"
    )

    summary = _status_json(live)
    assert victim.peer_id not in {n["peer_id"] for n in summary["nodes"]}
    assert len(summary["nodes"]) == 2
    shard = summary["shards"][doubled]
    assert shard["replicas"] == 1 and victim.peer_id not in shard["holders"]
    assert doubled in summary["under_replicated"]
    assert sorted(summary["under_replicated"]) == [0, 1]
