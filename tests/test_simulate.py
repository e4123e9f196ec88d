"""`spes-node simulate` never deletes what it was given, and run ids never strand the user: simulate takes
--run-id and prints the status command for its swarm, a node logs complete join and status commands, and a
run id that is not found names the swarms that are there instead of inviting to found another."""

from __future__ import annotations

import json
import logging
import os
import shlex
from pathlib import Path

import hivemind
import pytest
from click.testing import CliRunner
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

import spes_node.daemon.simulation
import spes_node.logs
from spes_node.cli import main
from spes_node.config import load_preset
from spes_node.daemon import status
from spes_node.daemon.node import Node, NodeError, NodeOptions
from spes_node.daemon.simulation import new_run_dir, table
from spes_node.swarm import records
from spes_node.swarm.bootstrap import start_bootstrap
from spes_node.swarm.identity import load_or_create_identity
from spes_node.swarm.records import NodeInfo
from spes_node.swarm.swarm_key import SwarmKey

FAKE_MADDR = "/ip4/127.0.0.1/tcp/4242/p2p/QmXZ8oXr4z2dFFU1Ms2mx6kzLb2fkz5o8W3BqzZJvtUNCp"


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    monkeypatch.setattr(spes_node.logs, "setup_logging", lambda *a, **k: None)
    for key in [k for k in os.environ if k.startswith("SPES_")]:
        monkeypatch.delenv(key)


def _one_line_error(result, *needles: str) -> str:
    assert result.exit_code not in (0, 1), (result.exit_code, result.exception)  # 1: an uncaught exception
    assert "Traceback" not in result.output + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("spes-node: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------ the work directory


def test_each_run_gets_a_new_directory_and_nothing_is_removed(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    first = new_run_dir(tmp_path)
    (first / "node0.log").write_text("first run")
    second = new_run_dir(tmp_path)
    assert first != second and first.parent == second.parent == tmp_path
    assert list(second.iterdir()) == []
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (first / "node0.log").read_text() == "first run"
    (first.parent / "run-041").mkdir()  # numbers go on after the highest, whatever is in between
    assert new_run_dir(tmp_path).name == "run-042"


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        new_run_dir(tmp_path / "file")
    with pytest.raises(ValueError, match="Not a directory"):
        new_run_dir(tmp_path / "file" / "below")
    assert (tmp_path / "file").read_text() == "x"


class FakeBootstrap:
    def get_visible_maddrs(self):
        return [FAKE_MADDR]

    def shutdown(self):
        pass


class FakeDaemon:
    """A `spes-node join` that has already exited (0) and wrote a line to its log."""

    def __init__(self, cmd, log_path, env):
        self.cmd, self.returncode = cmd, 0
        Path(log_path).write_text("fake daemon\n")

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode


@pytest.fixture
def fake_simulate(monkeypatch):
    """`spes-node simulate` in-process with a fake bootstrap and daemons that exit at once."""
    started: list[FakeDaemon] = []

    def start_daemon(cmd, log_path, env):
        started.append(FakeDaemon(cmd, log_path, env))
        return started[-1]

    monkeypatch.setattr(spes_node.daemon.simulation, "start_bootstrap", lambda *a, **k: FakeBootstrap())
    monkeypatch.setattr(spes_node.daemon.simulation, "start_daemon", start_daemon)
    monkeypatch.setattr(spes_node.daemon.simulation.records, "fetch_nodes", lambda *a, **k: {})

    def invoke(*args: str):
        return CliRunner().invoke(main, ["simulate", *args], catch_exceptions=True)

    invoke.started = started
    return invoke


def test_simulate_keeps_the_workdir_and_earlier_runs(tmp_path, fake_simulate):
    (tmp_path / "notes.txt").write_text("mine")
    first = fake_simulate("--workdir", str(tmp_path), "--nodes", "2", "--max-rounds", "1")
    assert first.exception is None or isinstance(first.exception, SystemExit), first.exception
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert [p.name for p in runs] == ["run-001"]
    first_files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert "run-001/config.json" in first_files and "run-001/node1.log" in first_files

    second = fake_simulate("--workdir", str(tmp_path), "--nodes", "2", "--max-rounds", "1")
    assert second.exception is None or isinstance(second.exception, SystemExit), second.exception
    assert (tmp_path / "notes.txt").read_text() == "mine"
    after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert set(first_files) <= set(after), "the second run removed files of the first"
    assert "run-002/config.json" in after
    assert "logs in " + str(tmp_path / "run-002") in second.stdout


def test_simulate_in_the_current_directory_removes_nothing(tmp_path, fake_simulate, monkeypatch):
    (tmp_path / "project.toml").write_text("keep me")
    monkeypatch.chdir(tmp_path)
    fake_simulate("--workdir", ".", "--nodes", "1")
    assert (tmp_path / "project.toml").read_text() == "keep me"
    assert (tmp_path / "run-001" / "config.json").exists()


def test_simulate_takes_a_run_id_and_prints_the_status_command(tmp_path, fake_simulate):
    result = fake_simulate("--workdir", str(tmp_path), "--nodes", "2", "--run-id", "demo-1")
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert f"spes-node status --peers {FAKE_MADDR} --run-id demo-1" in result.stdout
    for daemon in fake_simulate.started:
        assert daemon.cmd[daemon.cmd.index("--run-id") + 1] == "demo-1"
    assert len(fake_simulate.started) == 2


def test_simulate_default_run_id_is_printed(tmp_path, fake_simulate):
    result = fake_simulate("--workdir", str(tmp_path), "--nodes", "1")
    assert f"--peers {FAKE_MADDR} --run-id simulate" in result.stdout


def test_simulate_refuses_a_bad_run_id_before_starting_anything(tmp_path, fake_simulate):
    result = fake_simulate("--workdir", str(tmp_path / "w"), "--run-id", "two words")
    _one_line_error(result, "--run-id", "two words")
    assert not (tmp_path / "w").exists() and fake_simulate.started == []


def test_simulate_with_a_workdir_below_a_file_is_one_line(tmp_path, fake_simulate):
    (tmp_path / "file").write_text("x")
    _one_line_error(fake_simulate("--workdir", str(tmp_path / "file" / "w")), "--workdir", "Not a directory")
    assert fake_simulate.started == []


class Proc:
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


def test_live_table_shows_every_started_daemon():
    procs = [Proc(None), Proc(None), Proc(3)]
    rows = table(procs, {}, 1.0)[1:]
    assert len(rows) == 3
    assert [row.split()[0] for row in rows] == ["node0", "node1", "node2"]
    assert [row.split()[-1] for row in rows[:2]] == ["starting", "starting"]
    assert rows[2].split()[-2:] == ["exited", "3"]

    record = NodeInfo(
        peer_id="QmB", shards=[1], round=2, step=7, loss=4.5, state="training", public_name="node1"
    )
    seen = set()
    rows = table(procs, {"QmB": record}, 2.0, seen)[1:]
    assert rows[0].split()[-1] == "starting"
    assert rows[1].split() == ["node1", "1", "2", "7", "4.500", "0", "training"]
    # its record withdrawn as it leaves, the process still running: leaving, not starting again
    rows = table(procs, {}, 3.0, seen)[1:]
    assert [row.split()[-1] for row in rows[:2]] == ["starting", "leaving"]


# ------------------------------------------------------------------------------------ run ids on a real DHT
# (run these under the swarm lock: they start DHT peers)


@pytest.fixture(scope="module")
def simulated():
    """A bootstrap peer that holds the config of a swarm named 'simulate' (what `spes-node simulate` runs)."""
    bootstrap = start_bootstrap(["/ip4/127.0.0.1/tcp/0"])
    maddr = str(bootstrap.get_visible_maddrs()[0])
    validator = RSASignatureValidator(RSAPrivateKey())
    publisher = hivemind.DHT(
        initial_peers=[maddr], client_mode=True, record_validators=[validator], start=True
    )
    cfg = load_preset("tiny")
    assert records.publish_config(publisher, "simulate", cfg.to_json(), cfg.hash(), validator, 600)
    yield maddr, publisher
    publisher.shutdown()
    bootstrap.shutdown()


@pytest.mark.swarm
def test_status_with_the_default_run_id_names_the_swarm_that_is_there(simulated):
    maddr, _ = simulated
    result = CliRunner().invoke(main, ["status", "--peers", maddr, "--timeout", "2"])
    line = _one_line_error(result, "no swarm 'spes'", "'simulate'", "--run-id simulate")
    assert "--preset" not in line and "found it" not in line

    result = CliRunner().invoke(main, ["status", "--peers", maddr, "--run-id", "simulate", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["run_id"] == "simulate"


@pytest.mark.swarm
def test_join_with_another_run_id_names_the_swarm_that_is_there(simulated, tmp_path):
    maddr, _ = simulated
    # the default join timeout: the DHT's p2pd took over 1 s to start in a loaded suite run
    opts = NodeOptions(peers=[maddr], run_id="spes", checkpoint_dir=tmp_path)
    node = Node(None, opts)
    node.validator = RSASignatureValidator(load_or_create_identity(tmp_path / "identity.key"))
    node.dht = node._start_dht(str(tmp_path / "identity.key"))
    try:
        with pytest.raises(NodeError) as info:
            node._agree_on_config()
    finally:
        node.dht.shutdown()
    message = str(info.value)
    assert "no swarm 'spes'" in message and "'simulate'" in message and "--run-id simulate" in message
    assert "--preset" not in message and "found" not in message.replace("not found", "")
    assert "\n" not in message


@pytest.mark.swarm
def test_no_swarm_message_without_a_known_swarm_points_at_the_run_id(simulated, monkeypatch):
    _, publisher = simulated
    monkeypatch.setattr(status, "KNOWN_RUN_IDS", ("spes", "nothing-here"))
    message = status.no_swarm_message(publisher, "elsewhere")
    assert message.startswith("no swarm 'elsewhere' at the given peers: they answered")
    assert "check --run-id" in message and "--preset" not in message


@pytest.mark.swarm
def test_a_node_logs_complete_join_and_status_commands(tmp_path, caplog, monkeypatch):
    secret = SwarmKey.generate()
    (tmp_path / "swarm.key").write_text(secret)
    opts = NodeOptions(
        run_id="r-cmds", host_maddrs=["/ip4/127.0.0.1/tcp/0"], swarm_key=SwarmKey.from_text(secret)
    )
    node = Node(None, opts)
    node.validator = RSASignatureValidator(load_or_create_identity(tmp_path / "identity.key"))
    with caplog.at_level(logging.INFO, logger="spes_node.daemon.node"):
        dht = node._start_dht(str(tmp_path / "identity.key"))
    try:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        cfg = load_preset("tiny")
        assert records.publish_config(dht, "r-cmds", cfg.to_json(), cfg.hash(), node.validator, 600)
        messages = [r.getMessage() for r in caplog.records]
        assert not any(secret in m for m in messages), "the swarm key was logged"
        join = shlex.split(
            next(m for m in messages if m.startswith("to join this swarm: ")).split(": ", 1)[1]
        )
        watch = shlex.split(next(m for m in messages if m.startswith("to watch it: ")).split(": ", 1)[1])

        assert join[:2] == ["spes-node", "join"]
        params = main.commands["join"].make_context("join", join[2:]).params
        assert list(params["peers"]) == maddrs and params["run_id"] == "r-cmds"
        assert params["swarm_key_file"] == "YOUR_SWARM_KEY_FILE"

        assert watch[:2] == ["spes-node", "status"]
        args = [str(tmp_path / "swarm.key") if a == "YOUR_SWARM_KEY_FILE" else a for a in watch[1:]]
        result = CliRunner().invoke(main, [*args, "--json", "--timeout", "20"])
        assert result.exit_code == 0, result.output
        summary = json.loads(result.stdout)
        assert summary["run_id"] == "r-cmds" and summary["config_hash"] == cfg.hash()
    finally:
        dht.shutdown()


def test_status_command_of_simulate_parses():
    command = shlex.split(spes_node.daemon.simulation.status_command([FAKE_MADDR], "demo"))
    params = main.commands["status"].make_context("status", command[2:]).params
    assert list(params["peers"]) == [FAKE_MADDR] and params["run_id"] == "demo"
