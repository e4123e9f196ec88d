"""The benchmark code runs and its arithmetic is right (seconds; the benchmarks themselves are not tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import common, memory
from benchmarks.bytes_per_round import analytic, steady_rounds
from benchmarks.common import table
from benchmarks.link_utilisation import window_utilisation
from benchmarks.network_runs import round_windows
from benchmarks.run_all import gather
from benchmarks.swarm import NodeRun
from spes_node.config import load_preset
from spes_node.model.moe import analytic_param_count

REPO = Path(__file__).resolve().parent.parent


def test_analytic_spes_with_one_shard_is_diloco():
    cfg = load_preset("small").replace(swarm={"num_shards": 1})
    a = analytic(cfg, num_nodes=4)
    assert a["spes_refresh_received"] == 0
    assert a["spes_total"] == pytest.approx(a["diloco_total"])
    counts = analytic_param_count(cfg.model)
    assert a["diloco_total"] == pytest.approx(4 * 3 / 4 * counts["total"] * 2)


def test_analytic_spes_breakdown():
    cfg = load_preset("small").replace(swarm={"num_shards": 2, "refresh_every": 2})
    counts = analytic_param_count(cfg.model)
    a = analytic(cfg, num_nodes=4)
    assert a["spes_shard"] == pytest.approx(2 * counts["experts"] / 2 * 2)
    # every other round, each holder's int8 update of both rounds (refresh_by_updates is on by default)
    assert a["spes_refresh_received"] == pytest.approx(counts["experts"] / 2 * 1 / 2)
    assert a["server_total"] == pytest.approx(
        (counts["shared"] + counts["experts"] / 2 + counts["total"]) * 2
    )


def test_analytic_refresh_moves_fp16_weights_or_int8_updates():
    updates = {"num_shards": 2, "average": "updates", "wire_compression": "int8", "refresh_every": 1}
    whole = load_preset("small").replace(swarm={**updates, "refresh_by_updates": False})
    counts = analytic_param_count(whole.model)
    a = analytic(whole, num_nodes=4)
    assert a["spes_shard"] == pytest.approx(2 * counts["experts"] / 2 * 1)
    assert a["spes_refresh_received"] == pytest.approx(counts["experts"] / 2 * 2)  # weights, at fp16
    assert a["diloco_total"] == pytest.approx(4 * 3 / 4 * counts["total"] * 1)
    by_update = analytic(whole.replace(swarm={"refresh_by_updates": True}), num_nodes=4)
    assert by_update["spes_refresh_received"] == pytest.approx(counts["experts"] / 2 * 1)  # the int8 update
    every_other = whole.replace(swarm={"refresh_by_updates": True, "refresh_every": 2})
    assert analytic(every_other, 4)["spes_refresh_received"] == pytest.approx(
        counts["experts"] / 2 * 1 / 2
    ), "the int8 update of two rounds, every other round"


def test_the_steady_state_is_whole_refresh_periods_after_the_first_refresh():
    # windows 1-3 are complete; round 1's refresh takes whole shards
    assert list(steady_rounds(1, 4)) == [2, 3]
    assert list(steady_rounds(2, 5)) == [3, 4]  # round 2 takes whole shards; 3 (no refresh) and 4 (an update)
    assert list(steady_rounds(2, 6)) == [3, 4], "round 5 alone is half a period"
    with pytest.raises(ValueError, match="no whole refresh period"):
        steady_rounds(2, 4)


def test_memory_bound_for_all_experts_is_sixteen_bytes_per_parameter():
    cfg = load_preset("small")
    total = analytic_param_count(cfg.model)["total"]
    assert memory.analytic_bytes(cfg, 8, 8, "bf16") == 16 * total
    assert memory.analytic_bytes(cfg, 8, 1, "int8") < memory.analytic_bytes(cfg, 8, 1, "bf16")


def test_memory_probe_measures_a_tiny_model():
    """The probe runs in a fresh process, as the benchmark runs it: in a long-lived test worker the tiny model fits in
    heap pages the worker already has resident, so its resident set need not grow at all."""
    settings = {"preset": "tiny", "num_shards": 4, "steps": 1}
    result = memory._run_probe("one", "bf16", settings)
    assert result["peak_kib"] > 0
    assert result["tensor_bytes"]["frozen_buffers"] > 0
    assert len(result["step_seconds"]) == 1


def _timeline(rounds, counters):
    return {"rounds": rounds, "counters": counters}


def test_round_windows_attribute_bytes_and_find_the_transfer():
    counters = [
        {"sent": {}, "received": {}, "served": 0},
        {
            "sent": {"shared": 100, "shard": 50},
            "received": {"shared": 100, "shard": 50, "refresh": 400},
            "served": 7,
        },
        {
            "sent": {"shared": 200, "shard": 100},
            "received": {"shared": 200, "shard": 100, "refresh": 800},
            "served": 7,
        },
    ]
    rounds = [{"start": 10.0}, {"start": 20.0}, {"start": 30.0}]
    node = NodeRun("n0", Path("."), Path("."), 0, {}, _timeline(rounds, counters))
    rate_mbit = 8.0  # 1e6 bytes/s: "transferring" above 5e4 bytes/s
    samples = [(t / 2, 0, 0) for t in range(0, 24)]  # idle until t = 12
    samples += [(12.0 + k, 1_000_000 * (k + 1), 500_000 * (k + 1)) for k in range(4)]  # busy 12..15
    samples += [(16.0 + k, 4_000_000, 2_000_000) for k in range(20)]
    windows = round_windows(node, samples, rate_mbit)
    assert len(windows) == 2
    first = windows[0]
    assert first.payload_sent == {"shared": 100, "shard": 50, "refresh_served": 7}
    assert first.payload_received == {"shared": 100, "shard": 50, "refresh": 400}
    assert (first.wire_sent, first.wire_received) == (4_000_000, 2_000_000)
    assert (first.active_start, first.active_end) == (11.5, 15.0)
    u = window_utilisation(first, rate_mbit)
    assert u["utilisation_wire"] == pytest.approx(4_000_000 / 3.5 / 1e6)
    assert windows[1].active_start is None and window_utilisation(windows[1], rate_mbit) is None


def test_table_and_gather_handle_missing_numbers():
    text = table(["a", "b"], [["x", 1.23456], ["y", None]])
    assert "1.235" in text and "-" in text.splitlines()[-1]
    document = gather({"memory": {"memory_ratio": 0.4, "by_frozen_dtype": {}}}, {"quality": "boom"}, 1.0, {})
    assert document["goals"]["memory_ratio"]["met"] is True
    assert document["goals"]["throughput_ratio"]["met"] is None
    assert document["errors"] == {"quality": "boom"}
    json.dumps(document)
    # throughput on shaped links: its rate reaches latest.json, and the details name the file it wrote
    shaped = {
        "throughput_ratio": 0.9,
        "throughput_link_mbit": 100.0,
        "result_file": "throughput_100mbit.json",
    }
    document = gather({"throughput": shaped, "memory": {"memory_ratio": 0.4}}, {}, 1.0, {})
    assert document["throughput_link_mbit"] == 100.0
    assert document["details"] == {"throughput": "throughput_100mbit.json", "memory": "memory.json"}


def test_a_run_merged_alone_names_its_file_and_keeps_the_other_details(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    details = {"throughput": "throughput_100mbit.json", "memory": "memory.json"}
    (tmp_path / "latest.json").write_text(json.dumps({"throughput_ratio": 0.9, "details": details}))
    common.merge_latest({"throughput_ratio": 0.96}, details={"throughput": "throughput_100mbit_again.json"})
    document = json.loads((tmp_path / "latest.json").read_text())
    assert document["throughput_ratio"] == 0.96 and document["goals"]["throughput_ratio"]["met"] is True
    assert document["details"] == {"throughput": "throughput_100mbit_again.json", "memory": "memory.json"}


def test_gpu_step_script_runs_on_cpu_with_the_tiny_preset():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_step",
            "--tiny",
            "--device",
            "cpu",
            "--no-write",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--shards",
            "4",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "1 of 4" in out.stdout and "all" in out.stdout


def test_quality_benchmark_runs_and_writes_its_results(tmp_path, monkeypatch):
    from benchmarks import common, quality

    corpus = tmp_path / "corpus.jsonl"
    words = "def f(x):\n    return x + 1\n"
    corpus.write_text("".join(json.dumps({"text": words * (i + 3)}) + "\n" for i in range(40)))
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    (tmp_path / "results").mkdir()
    stale_goal = {"val_loss_ratio_vs_centralized": {"goal": "<= 1.05", "value": 9.0, "met": False}}
    (tmp_path / "results" / "latest.json").write_text(json.dumps({"memory_ratio": 0.4, "goals": stale_goal}))
    settings = {
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_experts": 4, "expert_ffn": 32},
        "data": {"source": str(corpus), "val_fraction": 0.2},
        "steps": 4,
        "sync_steps": 2,
        "merge_interval": 2,
        "merge_horizon": 4,
        "total_batch": 8,
        "seeds": [0, 1],
        "val_batches": 2,
        "curve_val_batches": 1,
        "heldout": False,
        "runs": [
            "centralized",
            "diloco",
            "spes_4x1",
            "spes_4x1_int8",
            "spes_4x1_refresh2",
            "spes_4x1_overlap",
            "spes_4x1_16e",
        ],
    }
    results = quality.run(tmp_path / "work", settings, figure=tmp_path / "curves.png")

    written = json.loads((tmp_path / "results" / "quality.json").read_text())
    assert written["results"]["partial"] is False
    assert set(written["results"]["summary"]) == set(settings["runs"])
    assert results["val_loss_ratio_vs_centralized"] == written["results"]["summary"]["spes_4x1"]["ratio_mean"]
    assert results["val_loss_ratio_std"] > 0  # two seeds that differ
    for name in settings["runs"]:
        assert len(written["results"]["runs"][name]["0"]["curve"]["val_loss"]) == 2
    assert written["results"]["runs"]["spes_4x1_int8"]["0"]["int8_relative_error_mean"] > 0
    assert written["results"]["equal_memory"]["spes_fits"] in (True, False)
    assert (tmp_path / "curves.png").stat().st_size > 0
    latest = json.loads((tmp_path / "results" / "latest.json").read_text())
    assert latest["memory_ratio"] == 0.4 and latest["val_loss_ratio_std"] == results["val_loss_ratio_std"]
    ratio = results["val_loss_ratio_vs_centralized"]
    assert latest["goals"]["val_loss_ratio_vs_centralized"] == {
        "goal": "<= 1.02",
        "value": ratio,
        "met": ratio <= 1.02,
    }


def test_link_allreduce_time_on_the_wire_and_utilisation():
    from benchmarks.link_allreduce import StepMeasure, summarize, wire_window

    rate_mbit = 8.0  # 1e6 bytes/s; "transferring" above 5e4 bytes/s
    # 10 samples a second: matchmaking chatter (3e4 B/s, above nothing) from t=0, the all-reduce from t=2 to t=6
    # at 5e5 B/s up and 2.5e5 B/s down, then idle until the step ends at t=7
    samples, sent, received = [], 0, 0
    for k in range(80):
        t = k / 10
        samples.append((t, sent, received))
        up, down = (5e4, 2.5e4) if 2.0 <= t < 6.0 else (3e3, 3e3)
        sent, received = sent + int(up), received + int(down)
    report = {
        "step": 1,
        "began": 0.0,
        "allreduce_began": 1.95,
        "done": 7.0,
        "averaged": True,
        "group_size": 3,
        "bytes_sent": 1_600_000,
        "bytes_received": 800_000,
        "cpu_seconds": {"python": 2.0, "p2pd": 1.0},
    }
    seconds, wire_sent, _ = wire_window(samples, report, rate_mbit)
    assert seconds == pytest.approx(4.0, abs=0.11)
    assert wire_sent == pytest.approx(2_000_000, rel=0.05)
    # without the all-reduce's start the window would open at matchmaking traffic above the threshold
    noisy = [(t, s * 20, r * 20) for t, s, r in samples]
    assert wire_window(noisy, {**report, "allreduce_began": None}, rate_mbit)[0] > 6.0

    measures = [
        StepMeasure(
            0,
            step,
            {**report, "step": step},
            seconds,
            wire_sent,
            0,
            0.9,
            {"tcp_segments_sent": 1000, "tcp_segments_retransmitted": 10 * step},
        )
        for step in (0, 1)
    ]
    summary = summarize(measures, rate_mbit)
    assert [row["step"] for row in summary["steps"]] == [0, 1]
    assert summary["tcp_retransmitted_by_step"] == [0.0, 0.01], (
        "each all-reduce's retransmissions, first included"
    )
    assert summary["utilisation_by_step"] == [pytest.approx(1_600_000 / (seconds * 1e6))] * 2
    assert summary["utilisation_median"] == pytest.approx(1_600_000 / (seconds * 1e6))
    assert summary["utilisation_down_median"] == pytest.approx(summary["utilisation_median"] / 2)
    assert summary["ideal_seconds_median"] == pytest.approx(1.6)
    assert summary["cpu_cores_busy_median"] == pytest.approx(3.0 / seconds)
    assert summary["peers_cpu_cores_busy_median"] == pytest.approx(3.0 / seconds)  # one peer, step 0 left out


def test_host_memory_counts_a_nodes_child_processes():
    """The host-memory sampler sums the PSS of a whole process tree: a child's 200 MB show up in its parent's tree
    and not in the parent's own figure."""
    from benchmarks.host_memory import tree_pss_kib

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; b = bytearray(200 << 20); print('ready', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        tree, own = tree_pss_kib(os.getpid())
        child_tree, _ = tree_pss_kib(child.pid)
        assert child_tree > 190 * 1024, child_tree
        assert tree - own >= child_tree, (tree, own, child_tree)
    finally:
        child.stdin.close()
        child.wait(30)


def _sim_base(tmp_path):
    """A one-layer model on a small corpus, H = 4, for the quality simulation's tests."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": "def f(x):\n    return x\n" * (i + 3)}) + "\n" for i in range(40))
    )
    return load_preset("tiny").replace(
        model={"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_experts": 4, "expert_ffn": 32},
        data={"source": str(corpus), "val_fraction": 0.2},
        swarm={"sync_steps": 4, "merge_alpha0": 0.0},
    )


def _sim_swarm(base, setting):
    """A simulated swarm of `setting` on `base` (see `_sim_base`), every node from seed 0's initial weights."""
    from benchmarks.quality_sim import SimSwarm, initial_weights, reshard, setting_config
    from spes_node.model.tokenizer import load_tokenizer

    cfg = setting_config(base, setting, total_batch=4)
    init = reshard(initial_weights(cfg, 0), cfg.model.num_layers, setting.num_shards)
    return SimSwarm(cfg, setting, init, load_tokenizer(cfg.data.tokenizer), seed=0)


def test_simulated_overlap_applies_the_round_with_the_progress_made_since(tmp_path):
    from benchmarks.quality_sim import Setting
    from spes_node.model.ownership import shared_parameters

    base = _sim_base(tmp_path)
    setting = Setting("overlap", 2, 1, merge=False, overlap_steps=2)
    swarm = _sim_swarm(base, setting)
    swarm.train_round()
    swarm.sync()
    a, b = swarm.nodes
    name = next(iter(dict(shared_parameters(a.model))))

    def weight(node):
        return dict(shared_parameters(node.model))[name].detach().clone()

    # in flight: the nodes keep their own weights, and the swarm's model is their average
    assert not torch.equal(weight(a), weight(b))
    averaged = (weight(a) + weight(b)) / 2
    assert torch.allclose(swarm.global_weights()[name], averaged)
    before = {node.index: weight(node) for node in swarm.nodes}
    swarm._steps(0, 2)
    progress = {node.index: weight(node) - before[node.index] for node in swarm.nodes}
    assert all(p.abs().max() > 0 for p in progress.values())
    swarm.land()
    for node in swarm.nodes:  # landed: the average, plus what the node trained since
        assert torch.allclose(weight(node), averaged + progress[node.index], atol=1e-6)
    assert swarm.pending is None

    # blended instead: half the local weights, half the round's result
    blended = _sim_swarm(base, Setting("blend", 2, 1, merge=False, overlap_steps=2, overlap_blend=0.5))
    blended.train_round()
    blended.sync()
    averaged = (weight(blended.nodes[0]) + weight(blended.nodes[1])) / 2
    blended._steps(0, 2)
    local = {node.index: weight(node) for node in blended.nodes}
    blended.land()
    for node in blended.nodes:
        assert torch.allclose(weight(node), 0.5 * local[node.index] + 0.5 * averaged, atol=1e-6)


def test_simulated_overlap_of_the_shards_only_applies_the_shared_average_at_once(tmp_path):
    from benchmarks.quality_sim import Setting
    from spes_node.model.ownership import shared_parameters

    base = _sim_base(tmp_path)
    # 2 nodes holding the same shard, so that the shard has a group to average in
    setting = Setting("overlap_shards", 1, 2, merge=False, overlap_steps=2, overlap_groups=("shard",))
    swarm = _sim_swarm(base, setting)
    swarm.train_round()
    a, b = swarm.nodes
    shard_before = {n.index: {k: v.clone() for k, v in n.group("shard").items()} for n in (a, b)}
    swarm.sync()
    shared_a, shared_b = dict(shared_parameters(a.model)), dict(shared_parameters(b.model))
    assert all(torch.equal(shared_a[k], shared_b[k]) for k in shared_a), (
        "the shared average is applied at once"
    )
    for node in (a, b):  # the shards' all-reduce is in flight: the nodes keep their own shard weights
        assert all(torch.equal(v, shard_before[node.index][k]) for k, v in node.group("shard").items())
    assert {entry[1] for entry in swarm.pending} == {"shard"}
    swarm.land()
    assert all(torch.equal(v, b.group("shard")[k]) for k, v in a.group("shard").items())


def test_simulated_shared_lag_lands_the_shared_average_a_step_in_and_the_shards_later(tmp_path):
    from benchmarks.quality_sim import Setting

    base = _sim_base(tmp_path)
    setting = Setting(
        "shared1", 1, 2, merge=False, overlap_steps=3, overlap_groups=("shard",), shared_lag_steps=1
    )
    swarm = _sim_swarm(base, setting)
    cfg = swarm.cfg
    swarm.train_round()
    swarm.sync()
    a, b = swarm.nodes
    assert sorted((entry[1], entry[4]) for entry in swarm.pending if entry[0] is a) == [
        ("shard", 3),
        ("shared", 1),
    ]
    pending = {(entry[0].index, entry[1]): entry for entry in swarm.pending}
    landed_at = {}
    original = swarm._land

    def land(lag=None):
        kind = "shared" if lag == 1 else "shard"
        # a group lands as the round's result plus the local progress made since the sync
        expected = {}
        for n in (a, b):
            _, _, at_sync, result, _ = pending[(n.index, kind)]
            expected[n.index] = {k: result[k] + (v - at_sync[k]) for k, v in n.group(kind).items()}
        original(lag)
        landed_at[lag] = [n.trainer.step for n in (a, b)]
        for n in (a, b):
            for k, v in n.group(kind).items():
                assert torch.allclose(v, expected[n.index][k], atol=1e-6), (lag, k)

    swarm._land = land
    swarm.train_round()
    H = cfg.swarm.sync_steps
    assert landed_at == {1: [H + 1, H + 1], 3: [H + 3, H + 3]}
    assert swarm.pending is None


def test_simulated_unequal_cards_train_their_extra_steps_each_round(tmp_path):
    from benchmarks.quality_sim import Setting

    base = _sim_base(tmp_path)
    setting = Setting("uneven", 2, 1, merge=False, extra_steps=(0, 3))
    swarm = _sim_swarm(base, setting)
    cfg = swarm.cfg
    tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.train.seq_len
    for round_ in (1, 2):
        _, tokens = swarm.train_round()
        swarm.sync()
        assert [node.trainer.step for node in swarm.nodes] == [4 * round_, 7 * round_]
        assert tokens == (4 + 7) * tokens_per_step


def test_throughput_steady_state_begins_at_the_first_sync_whatever_round_1_trained():
    from benchmarks.swarm import NodeRun
    from benchmarks.throughput import _mean_stalled, _mean_steady, node_rate

    # H = 2; round 1 trained one step past H while waiting (3 steps of 1 s, 100 tokens each), then a 2 s sync,
    # round 2's 2 steps and a 2 s sync, round 3's 2 steps and its sync
    steps = [[t, 100, 1.0] for t in (1.0, 2.0, 3.0, 6.0, 7.0, 10.0, 11.0)]
    rounds = [
        {"start": 4.0, "end": 5.0, "report": {"steps": 3, "stalled": 2.0, "shared_landed_at": 0.5}},
        {"start": 8.0, "end": 9.0, "report": {"steps": 2, "stalled": 2.0, "shared_landed_at": None}},
        # the last: the node leaves after it
        {"start": 12.0, "end": 13.0, "report": {"steps": 2, "stalled": 1.0, "shared_landed_at": 9.0}},
    ]
    rate = node_rate(NodeRun("n", Path("."), Path("n.log"), timeline={"steps": steps, "rounds": rounds}), 2)
    # steady state: from the end of round 1's last step (3.0) to the last step (11.0): 4 steps in 8 s
    assert rate["steady_seconds"] == 8.0 and rate["steady_tokens"] == 400
    assert rate["compute_share"] == 0.5
    assert rate["round_steps"] == [3, 2, 2]
    # the stalled seconds of the syncs inside that window, not of the last one
    assert rate["steady_stalled"] == [2.0, 2.0]
    assert _mean_stalled([rate]) == 2.0
    # when the shared result landed, over the steady rounds that landed it before the rest
    assert _mean_steady([rate], "steady_shared_landed_at") == 0.5


def test_throughput_drops_the_nodes_checkpoints_it_does_not_read(tmp_path):
    from benchmarks.swarm import NodeRun
    from benchmarks.throughput import _drop_checkpoints

    node = NodeRun("n", tmp_path / "node0", tmp_path / "node0.log")
    for step in (20, 40):
        (node.directory / f"step-{step:08d}").mkdir(parents=True)
        (node.directory / f"step-{step:08d}" / "model.safetensors").write_bytes(b"x" * 1024)
    (node.directory / "summary.json").write_text("{}")
    (node.directory / "timeline.json").write_text("{}")
    _drop_checkpoints([node])
    assert sorted(p.name for p in node.directory.iterdir()) == ["summary.json", "timeline.json"]


def test_startup_memory_runs_every_phase_on_the_tiny_preset(tmp_path, monkeypatch):
    """Each phase in a fresh process, as the benchmark runs them, in order (a resume reads what `write` wrote, an
    init what `hf-write` wrote); the results file is written."""
    from benchmarks import common, startup_memory

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    results = startup_memory.run(tmp_path / "work", dict(startup_memory.SETTINGS, preset="tiny"))
    assert results["make-new"]["state"] > 0 and results["write"]["bytes"] > 0
    assert results["hf-write"]["bytes"] > 0
    assert all(results[kind]["growth"] >= 0 for kind in ("make-new", "make-old", "init-new", "init-old"))
    assert results["resume-new"]["state"] == results["resume-old"]["state"] > 0
    assert (tmp_path / "results" / "startup_memory_tiny.json").is_file()


def test_shaped_network_counts_tcp_segments_per_namespace():
    """The link benchmark's retransmission figures come from each namespace's own TCP counters."""
    import subprocess
    import sys

    from benchmarks.netns import ShapedNetwork, check_available

    check_available()
    with ShapedNetwork(1, 50) as network:
        sent, retransmitted = network.tcp_segments(0)
        connect = (
            f"import socket; socket.socket().connect_ex(({network.host_ip!r}, 9))"  # refused: one SYN out
        )
        subprocess.run([*network.exec_prefix(0), sys.executable, "-c", connect], check=True, timeout=60)
        after = network.tcp_segments(0)
    assert after[0] > sent >= 0 and after[1] >= retransmitted >= 0


def test_shaped_network_sets_its_sysctls_in_every_namespace_and_refuses_one_it_cannot():
    """`--sysctl` of the link benchmark: a per-namespace setting lands in each peer's namespace, not the machine's."""
    from benchmarks.netns import NetnsUnavailable, ShapedNetwork, check_available

    check_available()
    key = "net.ipv4.tcp_rmem"
    machine = Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()
    wanted = ["4096", "131072", str(int(machine[2]) // 2)]
    with ShapedNetwork(2, None, sysctls={key: " ".join(wanted)}) as network:
        for i in range(2):
            read = subprocess.run(
                [*network.exec_prefix(i), "sysctl", "-n", key], capture_output=True, text=True, check=True
            )
            assert read.stdout.split() == wanted, read.stdout
    assert Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split() == machine
    with pytest.raises(NetnsUnavailable, match="cannot set net.ipv4.no_such_setting"):
        with ShapedNetwork(1, None, sysctls={"net.ipv4.no_such_setting": "1"}):
            pass


def test_shaped_network_drops_one_nodes_connections_to_another():
    """`--fresh connections` of the link benchmark: node 0's TCP connection to node 1 is reset, the other stays."""
    from benchmarks.netns import ShapedNetwork, check_available

    check_available()
    with ShapedNetwork(3, None) as network:
        server = (
            "import socket, sys; s = socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen(); print('up', flush=True)\n"
            "conns = [s.accept()[0] for _ in range(2)]\n"
            "sys.stdin.readline()"
        )
        listening = subprocess.Popen(
            [*network.exec_prefix(1), sys.executable, "-c", server],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert listening.stdout.readline().strip() == "up"
            client = (
                "import socket, sys, time; c = socket.create_connection((sys.argv[1], 7000)); print('in', flush=True)\n"
                "sys.stdin.readline()\n"
                "try:\n    c.sendall(b'x'); time.sleep(0.5); c.sendall(b'y'); print('open')\n"
                "except OSError as e:\n    print('reset', e.errno)"
            )
            clients = [
                subprocess.Popen(
                    [*network.exec_prefix(i), sys.executable, "-c", client, network.node_ip(1)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for i in (0, 2)
            ]
            for c in clients:
                assert c.stdout.readline().strip() == "in"
            network.drop_connections(0, 1)
            said = [c.communicate("go\n", timeout=60)[0].strip() for c in clients]
            assert said[0].startswith("reset") and said[1] == "open", said
        finally:
            listening.kill()
            listening.wait()
