import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import spes_node.daemon.node
import spes_node.logs
from spes_node.cli import main


class NodeStarted(Exception):
    """Raised instead of starting a node: bad input must be refused before the DHT starts."""


@pytest.fixture
def cli(monkeypatch):
    """Run `spes-node ...` in-process, with logging left alone and no node ever started."""

    def refuse(*_args, **_kwargs):
        raise NodeStarted("a node was started")

    monkeypatch.setattr(spes_node.daemon.node, "Node", refuse)
    monkeypatch.setattr(spes_node.logs, "setup_logging", lambda *a, **k: None)
    for key in [k for k in os.environ if k.startswith("SPES_")]:
        monkeypatch.delenv(key)

    def invoke(*args: str, env: dict[str, str] | None = None):
        return CliRunner().invoke(main, list(args), env=env, catch_exceptions=True)

    return invoke


def _assert_one_line_error(result, *needles: str) -> str:
    assert not isinstance(result.exception, NodeStarted), "the node started before the input was checked"
    assert result.exit_code != 0
    assert "Traceback" not in result.output + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("spes-node: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert result.stdout == ""
    return lines[0]


@pytest.fixture
def malformed(tmp_path) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text("[swarm\nnum_shards = 2\n")
    return path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPES_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _spes_node(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("spes-node")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "spes_node.cli"]
    return subprocess.run(
        command + list(args), capture_output=True, text=True, env=env or _env(), timeout=120
    )


def test_unknown_preset_subprocess_one_line():
    result = _spes_node("join", "--preset", "no-such-preset")
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        "spes-node: error: unknown preset 'no-such-preset' (available: small, spes-1b, spes-7b, tiny)"
    ]


def test_unknown_preset_from_environment_subprocess():
    result = _spes_node("join", env={**_env(), "SPES_PRESET": "no-such-preset"})
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr
    assert len(result.stderr.splitlines()) == 1 and "unknown preset 'no-such-preset'" in result.stderr


def test_unknown_preset(cli):
    _assert_one_line_error(cli("join", "--preset", "no-such-preset"), "no-such-preset", "tiny")


def test_malformed_config(cli, malformed):
    _assert_one_line_error(cli("join", "--config", str(malformed)), str(malformed))


def test_config_with_a_bad_field(cli, tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text("[swarm]\nnum_shards = 3\n")
    _assert_one_line_error(cli("join", "--config", str(path)), "swarm.num_shards")
    path.write_text("[swarm]\nshards = 2\n")
    _assert_one_line_error(cli("join", "--config", str(path)), "swarm.shards")


def test_missing_config(cli, tmp_path):
    _assert_one_line_error(cli("join", "--config", str(tmp_path / "nope.toml")), "nope.toml")


def test_config_and_preset_together(cli, malformed):
    _assert_one_line_error(
        cli("join", "--config", str(malformed), "--preset", "tiny"), "--config", "--preset"
    )


@pytest.mark.parametrize("value", ["x", "-1", "1.5", ""])
def test_shard_not_a_number(cli, value):
    _assert_one_line_error(cli("join", "--preset", "tiny", "--shard", value), "--shard")


@pytest.mark.parametrize("value", ["a.b", "with space", "x" * 65, "", "r/1"])
def test_bad_run_id(cli, value):
    _assert_one_line_error(cli("join", "--preset", "tiny", "--run-id", value), "--run-id")


def test_max_rounds_below_one(cli):
    _assert_one_line_error(cli("join", "--preset", "tiny", "--max-rounds", "0"), "--max-rounds")


def test_shard_out_of_range(cli):
    _assert_one_line_error(cli("join", "--preset", "tiny", "--shard", "4"), "--shard", "4")


def test_unreadable_data_path(cli, tmp_path):
    _assert_one_line_error(cli("join", "--preset", "tiny", "--data", str(tmp_path / "none.jsonl")), "data")


def test_relay_without_peers(cli):
    _assert_one_line_error(cli("join", "--preset", "tiny", "--auto-relay"), "--auto-relay", "--peers")


def test_relay_without_peer_id(cli):
    peer = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWCnLmjc8oo1X4AgZxffePQrQuqwX7FTqfg3QTq4mSn26q"
    _assert_one_line_error(
        cli("join", "--preset", "tiny", "--peers", peer, "--relay", "/ip4/127.0.0.1/tcp/2"),
        "--relay",
        "/p2p/",
    )


def test_unknown_device(cli):
    _assert_one_line_error(cli("join", "--preset", "tiny", "--device", "gpu"), "device")


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"SPES_PRESET": "no-such-preset"}, "no-such-preset"),
        ({"SPES_PRESET": "tiny", "SPES_RUN_ID": "a.b"}, "--run-id"),
        ({"SPES_PRESET": "tiny", "SPES_SHARD": "x"}, "--shard"),
        ({"SPES_PRESET": "tiny", "SPES_MAX_ROUNDS": "0"}, "--max-rounds"),
        ({"SPES_CONFIG": "{malformed}"}, "bad.toml"),
    ],
)
def test_flags_read_the_environment(cli, malformed, env, needle):
    env = {k: v.replace("{malformed}", str(malformed)) for k, v in env.items()}
    _assert_one_line_error(cli("join", env=env), needle)


def test_valid_flags_reach_the_node(cli, tmp_path, monkeypatch):
    started = {}

    class FakeNode:
        def __init__(self, cfg, opts):
            started.update(cfg=cfg, opts=opts)

        def install_signal_handlers(self):
            pass

        def run(self):
            pass

    monkeypatch.setattr(spes_node.daemon.node, "Node", FakeNode)
    env = {"SPES_RUN_ID": "from-env", "SPES_MAX_ROUNDS": "3", "SPES_DEVICE": "cpu"}
    result = cli(
        "join", "--preset", "tiny", "--shard", "2", "--checkpoint-dir", str(tmp_path / "ck"), env=env
    )
    assert result.exit_code == 0, result.output + result.stderr
    opts = started["opts"]
    assert started["cfg"].name == "tiny"
    assert (opts.run_id, opts.max_rounds, opts.device, opts.shard) == ("from-env", 3, "cpu", 2)
    assert opts.checkpoint_dir == tmp_path / "ck"


def test_every_option_reads_its_environment_variable():
    checked = 0
    for name, command in main.commands.items():
        for param in command.params:
            if not isinstance(param, click.Option) or param.name == "help":
                continue
            flag = next(opt for opt in param.opts if opt.startswith("--"))
            expected = "SPES_" + flag[2:].upper().replace("-", "_")
            assert param.envvar == expected, f"{name} {flag}: envvar {param.envvar!r}"
            checked += 1
    assert checked >= 20


def test_help(cli):
    top = cli("--help")
    assert top.exit_code == 0
    for command in ("join", "simulate", "dht"):
        assert command in top.output
    join = cli("join", "--help")
    assert join.exit_code == 0
    for flag in ("--peers", "--config", "--preset", "--run-id", "--shard", "--data", "--max-rounds"):
        assert flag in join.output
    assert "SPES_PRESET" in join.output


def test_help_subprocess():
    result = _spes_node("--help")
    assert result.returncode == 0, result.stderr
    assert "join" in result.stdout and "Traceback" not in result.stderr
    result = _spes_node("join", "--help")
    assert result.returncode == 0 and "--checkpoint-dir" in result.stdout


HEAVY = ("torch", "hivemind", "transformers", "datasets")
"""What a command imports only when it runs: its help, `plan` and its flag errors answer without them."""


@pytest.mark.parametrize(
    "args, exit_code",
    [
        (["--help"], 0),
        (["status", "--help"], 0),
        (["plan", "--preset", "spes-7b", "--device-memory", "48GB"], 0),
        (["join", "--config-hash", "abc"], 2),
        (["join", "--preset", "tiny", "--shard", "9"], 2),
        (["status", "--peers", "/ip4/127.0.0.1/tcp/1", "--config-hash", "xyz"], 2),
        (["export", "--out", "x"], 2),
    ],
)
def test_help_plan_and_flag_errors_import_no_heavy_library(args, exit_code):
    # run in a fresh interpreter: this test process has imported all of them already
    probe = (
        "import sys\n"
        "from spes_node.cli.main import run\n"
        "sys.argv = ['spes-node', *sys.argv[1:]]\n"
        "try:\n"
        "    run()\n"
        "finally:\n"
        f"    print('loaded:', sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, *args], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert result.returncode == exit_code, result.stderr
    assert result.stderr.splitlines()[-1] == "loaded: []", result.stderr
    assert "Traceback" not in result.stderr
