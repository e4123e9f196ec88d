"""--shards/--max-shards: parsing, the capacity from the memory plan, and the join command's one-line refusals."""

import logging
import os
import re
import time

import pytest
import torch
from click.testing import CliRunner
from swarm_utils import Swarm

import spes_node.daemon.capacity
import spes_node.daemon.node
import spes_node.devices
import spes_node.logs
from spes_node.cli import main
from spes_node.config import load_preset
from spes_node.daemon.capacity import ShardRequest, parse_shard_request, shard_capacity
from spes_node.daemon.plan import GIB, host_need, max_shards
from spes_node.procs import descendants

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("shards", "max_shards", "shard", "expected"),
    [
        ("auto", None, "auto", ShardRequest()),
        ("AUTO", 3, "auto", ShardRequest(max_shards=3)),
        ("2", None, "auto", ShardRequest(count=2)),
        ("0,2", None, "auto", ShardRequest(indices=(0, 2))),
        (" 3 , 1 ", 2, "auto", ShardRequest(indices=(3, 1), max_shards=2)),
        ("auto", None, "1", ShardRequest(indices=(1,))),
    ],
)
def test_parse_shard_request(shards, max_shards, shard, expected):
    assert parse_shard_request(shards, max_shards, shard) == expected


@pytest.mark.parametrize(
    ("shards", "max_shards", "shard", "needle"),
    [
        ("0", None, "auto", "--shards"),
        ("-1", None, "auto", "--shards"),
        ("two", None, "auto", "--shards"),
        ("0,a", None, "auto", "--shards"),
        ("1,1", None, "auto", "twice"),
        ("3", 2, "auto", "--max-shards 2"),
        ("0,1,2", 2, "auto", "--max-shards 2"),
        ("auto", 0, "auto", "--max-shards"),
        ("0,2", None, "1", "--shard and --shards"),
        ("auto", None, "x", "--shard"),
    ],
)
def test_parse_shard_request_refuses(shards, max_shards, shard, needle):
    with pytest.raises(ValueError, match=needle):
        parse_shard_request(shards, max_shards, shard)


def test_auto_on_a_cpu_holds_what_the_host_memory_fits():
    tiny = load_preset("tiny")
    assert shard_capacity(tiny, ShardRequest(), CPU, memory=64 * GIB) == 4
    assert shard_capacity(tiny, ShardRequest(max_shards=2), CPU, memory=64 * GIB) == 2
    spes_1b = load_preset("spes-1b")
    two = host_need(spes_1b, 2)
    assert host_need(spes_1b, 1) < two < host_need(spes_1b, 3)
    assert shard_capacity(spes_1b, ShardRequest(), CPU, memory=two) == 2
    assert shard_capacity(spes_1b, ShardRequest(), CPU, memory=two - 1) == 1


def test_a_cpu_short_of_memory_takes_one_shard_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="spes_node.daemon.capacity"):
        assert shard_capacity(load_preset("spes-1b"), ShardRequest(), CPU, memory=8 * GIB) == 1
    assert "holding one shard anyway" in caplog.text


def test_auto_on_a_gpu_follows_the_plan_and_refuses_what_cannot_fit():
    spes_7b = load_preset("spes-7b")
    fit_80 = max_shards(spes_7b, 80 * GIB)
    assert fit_80 >= 1
    assert shard_capacity(spes_7b, ShardRequest(), CUDA, memory=80 * GIB) == fit_80
    assert shard_capacity(spes_7b, ShardRequest(max_shards=1), CUDA, memory=80 * GIB) == 1
    with pytest.raises(ValueError) as refused:
        shard_capacity(spes_7b, ShardRequest(), CUDA, memory=16 * GIB)
    message = str(refused.value)
    assert "\n" not in message
    assert "does not fit this GPU even with one shard" in message and "16.00 GiB" in message
    with pytest.raises(ValueError, match="even with one shard"):
        shard_capacity(spes_7b, ShardRequest(indices=(0,)), CUDA, memory=16 * GIB)


def test_an_explicit_count_or_list_is_taken_as_given(caplog):
    tiny = load_preset("tiny")
    assert shard_capacity(tiny, ShardRequest(count=3), CPU, memory=64 * GIB) == 3
    assert shard_capacity(tiny, ShardRequest(indices=(3, 0)), CPU, memory=64 * GIB) == 2
    spes_7b = load_preset("spes-7b")
    fit = max_shards(spes_7b, 80 * GIB)
    with caplog.at_level(logging.WARNING, logger="spes_node.daemon.capacity"):
        assert shard_capacity(spes_7b, ShardRequest(count=fit + 1), CUDA, memory=80 * GIB) == fit + 1
    assert f"fits {fit} shard(s)" in caplog.text
    with pytest.raises(ValueError, match="swarm.num_shards"):
        shard_capacity(tiny, ShardRequest(count=5), CPU, memory=64 * GIB)
    with pytest.raises(ValueError, match="4 is out of range"):
        shard_capacity(tiny, ShardRequest(indices=(0, 4)), CPU, memory=64 * GIB)


# ---------------------------------------------------------------------------------------------- join's flags


class NodeStarted(Exception):
    pass


@pytest.fixture
def join(monkeypatch):
    """`spes-node join --preset tiny ...` in-process; the node is never started, its options are returned."""
    started = {}

    class FakeNode:
        def __init__(self, cfg, opts):
            started.update(cfg=cfg, opts=opts)

        def install_signal_handlers(self):
            pass

        def run(self):
            pass

    monkeypatch.setattr(spes_node.daemon.node, "Node", FakeNode)
    monkeypatch.setattr(spes_node.logs, "setup_logging", lambda *a, **k: None)
    for key in [k for k in os.environ if k.startswith("SPES_")]:
        monkeypatch.delenv(key)

    def invoke(*args: str, env=None):
        started.clear()
        result = CliRunner().invoke(main, ["join", *args], env=env, catch_exceptions=True)
        return result, started.get("opts")

    return invoke


def _one_line_error(result, opts, *needles):
    assert opts is None, "the node started before the input was checked"
    assert result.exit_code != 0
    assert "Traceback" not in result.output + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("spes-node: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--shards", "5"], ["--shards", "swarm.num_shards"]),
        (["--shards", "0,4"], ["--shards", "4 is out of range"]),
        (["--shards", "several"], ["--shards"]),
        (["--shards", "2,2"], ["twice"]),
        (["--max-shards", "0"], ["--max-shards"]),
        (["--shards", "3", "--max-shards", "2"], ["--max-shards 2"]),
        (["--shard", "1", "--shards", "0,2"], ["--shard and --shards"]),
        (["--shard", "4"], ["--shard", "4"]),
    ],
)
def test_join_refuses_bad_shard_flags_in_one_line(join, args, needles):
    _one_line_error(*join("--preset", "tiny", *args), *needles)


def test_join_refuses_a_config_that_cannot_fit_one_shard_on_the_gpu(join, monkeypatch):
    monkeypatch.setattr(spes_node.devices, "resolve_device", lambda device: CUDA)
    monkeypatch.setattr(
        spes_node.daemon.capacity, "device_memory", lambda device: (16 * GIB, "16.00 GiB card")
    )
    _one_line_error(
        *join("--preset", "spes-7b"), "does not fit this GPU even with one shard", "16.00 GiB card"
    )
    monkeypatch.setattr(
        spes_node.daemon.capacity, "device_memory", lambda device: (80 * GIB, "80.00 GiB card")
    )
    result, opts = join("--preset", "spes-7b")
    assert result.exit_code == 0, result.stderr
    assert opts.shards == ShardRequest()


def test_join_passes_the_request_to_the_node(join):
    result, opts = join("--preset", "tiny", "--shards", "0,2", "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    assert opts.shards == ShardRequest(indices=(0, 2)) and opts.shard is None
    result, opts = join("--preset", "tiny", "--max-shards", "2", env={"SPES_SHARDS": "2"})
    assert result.exit_code == 0, result.stderr
    assert opts.shards == ShardRequest(count=2, max_shards=2)
    result, opts = join("--preset", "tiny", "--shard", "3")
    assert result.exit_code == 0, result.stderr
    assert opts.shard == 3 and opts.shards.indices == (3,)
    result, opts = join("--peers", "/ip4/127.0.0.1/tcp/1/p2p/QmPeer", "--shards", "7,9")
    assert result.exit_code == 0, "without a config the node checks the indices once it has the swarm's"
    assert opts.shards.indices == (7, 9)


def _smaps_kib(pid: int, fields: tuple[str, ...]) -> int:
    try:
        text = open(f"/proc/{pid}/smaps_rollup").read()
    except OSError:  # exited meanwhile
        return 0
    return sum(int(kib) for name, kib in re.findall(r"^(\w+):\s+(\d+) kB", text, re.M) if name in fields)


def _tree_kib(node: int) -> int:
    """The node's process tree as a machine running it alone sees it: the node's resident set, each forked helper's
    own pages (what it shares with the node counts once, in the node), p2pd's and torch's shm manager's resident
    sets. Unlike PSS, it does not shrink when other processes (other tests' nodes) map the same libraries."""
    total = _smaps_kib(node, ("Rss",))
    for pid in descendants(node):
        try:
            forked = os.readlink(f"/proc/{pid}/exe") == os.readlink(f"/proc/{node}/exe")
        except OSError:  # exited meanwhile
            continue
        total += _smaps_kib(pid, ("Private_Clean", "Private_Dirty") if forked else ("Rss",))
    return total


@pytest.mark.swarm
def test_a_cpu_node_runs_within_the_plans_host_memory_and_near_it(tmp_path):
    """`host_need` is what `--shards auto` fits in a CPU node's memory. A tiny node's tensors are a few tens of MiB:
    its runtime (`HOST_RUNTIME_CPU`: interpreter, torch, hivemind's DHT and averager processes, p2pd) is most of
    what it measures, and it must neither be above the plan (a node would take more shards than fit) nor far under
    it (one that would fit would be refused)."""
    swarm = Swarm(tmp_path)
    try:
        node = swarm.start("a", "--max-rounds", "4", "--wait-peers", "1")
        peak = 0
        while node.poll() is None:
            peak = max(peak, _tree_kib(node.pid))
            time.sleep(0.2)
        assert node.returncode == 0, swarm.log("a")[-3000:]
    finally:
        swarm.close()
    need = host_need(swarm.cfg, 1)
    assert 0.6 * need <= peak * 1024 <= need, f"peak {peak / 1024:.0f} MiB, plan {need / 2**20:.0f} MiB"
