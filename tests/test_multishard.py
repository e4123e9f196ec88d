"""A node that holds several shards: it trains, averages, checkpoints and resumes all of them.

Unit tests: the rebalance move leaves the shard placement names (not just the most replicated one), and the
static memory of a node training several shards is what the memory plan says for that many. Swarm test: two
nodes with room for two shards each train tiny's four shards, a third raises replication and averages with the
holders, and a restarted node gets its shards back; two nodes started on the same shard: one moves to a shard nobody
holds and trains it.
"""

from __future__ import annotations

import re
import signal

import pytest
import torch
from swarm_utils import Swarm

from spes_node.config import load_preset
from spes_node.daemon.plan import memory_plan
from spes_node.daemon.round import rebalance_move
from spes_node.daemon.trainer import Trainer
from spes_node.model.moe import MoEForCausalLM
from spes_node.model.ownership import apply_ownership, shard_tensors
from spes_node.swarm.records import NodeInfo

# ---------------------------------------------------------------------------------------------- rebalance


def test_a_node_with_several_shards_leaves_the_one_placement_names():
    # shard 2 has no holder; a (reachable) holds 0 and 1. Leaving 0, the most replicated, would leave shard 0 to
    # two client-mode nodes that nobody can download from: placement has a leave 1 instead
    swarm_cfg = load_preset("tiny").replace(swarm={"num_shards": 4, "replication_target": 2}).swarm
    nodes = {
        "a": NodeInfo(peer_id="a", shards=[0, 1], state="training"),
        "b": NodeInfo(peer_id="b", shards=[1], state="training"),
        "c": NodeInfo(peer_id="c", shards=[3], state="training"),
        "d": NodeInfo(peer_id="d", shards=[3], state="training"),
        "n1": NodeInfo(peer_id="n1", shards=[0], state="training", client_mode=True),
        "n2": NodeInfo(peer_id="n2", shards=[0], state="training", client_mode=True),
    }
    assert rebalance_move(nodes, nodes["a"], (0, 1), swarm_cfg) == (1, 2)
    others = [n for peer, n in nodes.items() if peer != "a"]
    assert all(rebalance_move(nodes, n, tuple(n.shards), swarm_cfg) is None for n in others)
    # once it moved, a keeps both of its shards (a client leaves crowded shard 0 for 1 next)
    nodes["a"] = NodeInfo(peer_id="a", shards=[0, 2], state="training")
    assert rebalance_move(nodes, nodes["a"], (0, 2), swarm_cfg) is None
    assert rebalance_move(nodes, nodes["n1"], (0,), swarm_cfg) == (0, 1)


# ---------------------------------------------------------------------------------------------- memory


class _RandomBatches:
    def __init__(self, cfg):
        self.cfg, self.generator = cfg, torch.Generator().manual_seed(0)

    def next_batch(self) -> torch.Tensor:
        t = self.cfg.train
        shape = (t.micro_batch_size, t.seq_len + 1)
        return torch.randint(0, self.cfg.model.vocab_size, shape, generator=self.generator)


@pytest.mark.parametrize("owned", [[1], [0, 2], [3, 0, 1]])
def test_static_memory_of_a_node_training_several_shards_is_the_plans(owned):
    """What the node builds (ownership of its first shard, then `Trainer.set_ownership` of all, as on resume or
    a move): trainable weights, gradients, AdamW moments and frozen experts, exactly as `memory_plan` counts them."""
    cfg = load_preset("tiny").replace(swarm={"frozen_dtype": "bf16"})
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, owned[:1], cfg.swarm.frozen_dtype)
    trainer = Trainer(cfg, model, _RandomBatches(cfg), torch.device("cpu"))
    trainer.set_ownership(owned)
    grads: dict[str, int] = {}
    trainer.optimizer.register_step_pre_hook(
        lambda optimizer, *_: grads.update(
            bytes=sum(p.grad.nbytes for g in optimizer.param_groups for p in g["params"])
        )
    )
    trainer.train_step()

    plan = memory_plan(cfg, len(owned))
    moments = [v for state in trainer.optimizer.state.values() for v in state.values() if v.ndim > 0]
    measured = {
        "weights": sum(p.nbytes for p in model.parameters() if p.requires_grad),
        "grads": grads["bytes"],
        "optimizer": sum(v.nbytes for v in moments),
        "frozen": sum(b.nbytes for b in model.buffers()),
    }
    assert measured == {key: getattr(plan, key) for key in measured}
    assert sorted({int(n.split(".mlp.shards.")[1].split(".")[0]) for n, p in model.named_parameters()
                   if ".mlp.shards." in n and p.requires_grad}) == sorted(owned)  # fmt: skip


# ---------------------------------------------------------------------------------------------- swarm


def _record(swarm: Swarm, name: str):
    return next((n for n in swarm.nodes().values() if n.public_name == name and n.shards), None)


def _initial_model(cfg) -> MoEForCausalLM:
    """The weights every node starts from (the founder's; a joiner downloads them)."""
    return MoEForCausalLM(cfg.model, cfg.swarm.num_shards, seed=cfg.train.seed)


def _model_of(cfg, checkpoint) -> MoEForCausalLM:
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, checkpoint.meta["shards"], cfg.swarm.frozen_dtype)
    model.load_state_dict(checkpoint.tensors)
    return model


def _groups(summary: dict, shard: int) -> list[int]:
    """The group size of `shard`'s all-reduce in each round of a node's summary that held it."""
    return [
        r["shard_groups"][str(shard)] for r in summary["rounds"] if str(shard) in r.get("shard_groups", {})
    ]


@pytest.mark.swarm
@pytest.mark.timeout(1200)
def test_two_nodes_train_every_shard_a_third_raises_replication_and_a_restart_keeps_its_shards(tmp_path):
    swarm = Swarm(tmp_path, run_id="multi", averaging_timeout=20.0, matchmaking_time=4.0)
    try:
        _run(swarm)
    finally:
        swarm.close()


def _run(swarm: Swarm) -> None:
    cfg = swarm.cfg
    swarm.start("a", "--shards", "2")
    a = swarm.wait_for(lambda: _record(swarm, "a"), 120, "a's record")
    swarm.start("b", "--shards", "auto", "--max-shards", "2")
    b = swarm.wait_for(lambda: _record(swarm, "b"), 120, "b's record")
    assert len(a.shards) == len(b.shards) == 2, (a.shards, b.shards)
    assert sorted(a.shards + b.shards) == [0, 1, 2, 3], "two nodes with room for two hold all four shards"
    assert "room for 2 of 4 shards" in swarm.log("b")
    assert f"training shards {a.shards}" in swarm.log("a")

    def rounds_done(name: str, rounds: int):
        record = _record(swarm, name)
        return record is not None and record.round >= rounds

    swarm.wait_for(lambda: rounds_done("a", 2) and rounds_done("b", 2), 300, "a and b at round 2")

    # a third node with room for two: every shard has a holder, so it takes two held ones and averages with them
    # (it runs until it has: on a loaded machine a holder can miss a round's matchmaking now and then)
    swarm.start("c", "--shards", "2")
    c_shards = swarm.wait_for(lambda: _record(swarm, "c"), 120, "c's record").shards

    def c_averaged_every_shard() -> bool:
        log = swarm.log("c")
        return all(re.search(rf"shard {shard} group 2\b", log) for shard in c_shards)

    swarm.wait_for(
        c_averaged_every_shard, 480, f"c averaging each of its shards {c_shards} with their holders"
    )
    swarm.procs["c"].send_signal(signal.SIGTERM)
    assert swarm.wait_exit("c", 60) == 0, swarm.log("c")[-3000:]
    c = swarm.summary("c")
    held = {"a": a.shards, "b": b.shards}
    assert len(c["shards"]) == 2 and c["shard"] == c["shards"][0] and c["shards"] == c_shards, c["shards"]
    for shard in c["shards"]:
        holder = next(name for name, shards in held.items() if shard in shards)
        assert 2 in _groups(c, shard), f"c never averaged shard {shard} with {holder}: {c['rounds']}"

    for name in ("a", "b"):
        swarm.procs[name].send_signal(signal.SIGTERM)
        assert swarm.wait_exit(name, 60) == 0, swarm.log(name)[-3000:]
    summaries = {name: swarm.summary(name) for name in ("a", "b")}
    for name, summary in summaries.items():
        assert summary["shards"] == held[name] and summary["shard"] == held[name][0], summary["shards"]
        assert "moving from shard" not in swarm.log(name), "a swarm built by placement needs no move"
        for shard in held[name]:
            groups = _groups(summary, shard)
            assert len(groups) == summary["rounds_done"], (shard, summary["rounds"])
            # averaged with c when c held it (c's rounds are a's and b's too), alone otherwise
            assert (2 in groups) == (shard in c["shards"]), (name, shard, groups)

    # every shard trained: its holder's weights moved away from the initial ones; the checkpoint holds them all
    initial = _initial_model(cfg)
    for name in ("a", "b"):
        checkpoint = swarm.checkpoint(name)
        assert checkpoint.meta["shards"] == held[name]
        model = _model_of(cfg, checkpoint)
        for shard in held[name]:
            for key, before in shard_tensors(initial, shard).items():
                after = shard_tensors(model, shard)[key]
                assert (after - before).abs().max() > 1e-3, f"{name}: {key} did not move"
        trained = {
            n.split(".mlp.shards.")[1].split(".")[0]
            for n in checkpoint.optimizer["by_name"]
            if ".mlp.shards." in n
        }
        assert sorted(int(s) for s in trained) == sorted(held[name]), "AdamW state of every own shard"
        # the node's static memory is the plan's for two shards (tiny keeps frozen experts in its checkpoints)
        plan = memory_plan(cfg, 2)
        moments = [
            v for state in checkpoint.optimizer["by_name"].values() for v in state.values() if v.ndim > 0
        ]
        assert sum(v.nbytes for v in moments) == plan.optimizer
        frozen = [t for n, t in checkpoint.tensors.items()
                  if ".mlp.shards." in n and int(n.split(".mlp.shards.")[1].split(".")[0]) not in held[name]]  # fmt: skip
        assert sum(t.nbytes for t in frozen) == plan.frozen

    # a restarted node gets its shards back from its checkpoint, whatever placement would now give it
    swarm.start("a", "--max-rounds", "1")
    assert swarm.wait_exit("a", 300) == 0, swarm.log("a")[-3000:]
    assert "resumed from" in swarm.log("a")
    assert f"training shards {held['a']}" in swarm.log("a")
    assert swarm.summary("a")["shards"] == held["a"]
    assert swarm.checkpoint("a").meta["shards"] == held["a"]


@pytest.mark.swarm
@pytest.mark.timeout(900)
def test_a_replica_moves_to_a_shard_nobody_holds_and_trains_it(tmp_path):
    """Two nodes started on shard 0: placement puts coverage before replication, so after a round one of them moves
    to a shard nobody holds (`SpesRound._maybe_rebalance`), takes it from its own frozen copy, and trains it from
    then on: its checkpoint holds the new shard's AdamW state and no other's, the new shard's weights moved away
    from the swarm's initial ones, and the two nodes go on averaging the shared parameters."""
    swarm = Swarm(tmp_path, run_id="move", averaging_timeout=20.0, matchmaking_time=4.0)
    try:
        swarm.start("a", "--shard", "0")
        swarm.wait_for(lambda: _record(swarm, "a"), 120, "a's record")
        swarm.start("b", "--shard", "0", "--max-rounds", "6")
        assert swarm.wait_exit("b", 600) == 0, swarm.log("b")[-3000:]
        swarm.procs["a"].send_signal(signal.SIGTERM)
        assert swarm.wait_exit("a", 60) == 0, swarm.log("a")[-3000:]
        moves = {
            name: re.findall(r"moving from shard 0 to shard (\d+)", swarm.log(name)) for name in ("a", "b")
        }
        movers = [name for name, found in moves.items() if found]
        assert len(movers) == 1 and len(moves[movers[0]]) == 1, moves
        mover, stayer = movers[0], next(name for name in moves if name not in movers)
        new = int(moves[mover][0])
        assert new != 0 and f"now training shard {new} (was 0)" in swarm.log(mover)
        summary = swarm.summary(mover)
        assert summary["shards"] == [new], summary["shards"]
        assert swarm.summary(stayer)["shards"] == [0]
        rounds = summary["rounds"]
        moved_at = next(i for i, r in enumerate(rounds) if r["shards"] == [new])  # the round it moved after
        after = rounds[moved_at + 1 :]
        assert after, f"{mover} ran no round after its move: {summary['rounds']}"
        assert any(r["shared_group"] == 2 for r in after), f"no shared group after the move: {after}"
        assert all(str(new) in r.get("shard_groups", {}) for r in after), after

        cfg = swarm.cfg
        checkpoint = swarm.checkpoint(mover)
        assert checkpoint.meta["shards"] == [new]
        trained = {int(n.split(".mlp.shards.")[1].split(".")[0])
                   for n in checkpoint.optimizer["by_name"] if ".mlp.shards." in n}  # fmt: skip
        assert trained == {new}, "AdamW state of the new shard only"
        initial, model = _initial_model(cfg), _model_of(cfg, checkpoint)
        for key, before in shard_tensors(initial, new).items():
            assert (shard_tensors(model, new)[key] - before).abs().max() > 1e-3, f"{key} was not trained"
    finally:
        swarm.close()


@pytest.mark.swarm
@pytest.mark.timeout(900)
def test_frozen_shards_refreshed_one_at_a_time_end_as_their_holders_trained_them(tmp_path):
    # swarm.refresh_parallel = 1: each node's two frozen shards download one after the other, the second once the
    # first is loaded; after the last round each node's frozen copies are its partner's own shards as they ended
    swarm = Swarm(
        tmp_path, run_id="one-at-a-time", refresh_parallel=1, refresh_by_updates=False, matchmaking_time=4.0
    )
    try:
        swarm.start("a", "--shards", "2", "--max-rounds", "3", "--wait-peers", "2")
        swarm.wait_for(lambda: _record(swarm, "a"), 120, "a's record")
        swarm.start("b", "--shards", "2", "--max-rounds", "3", "--wait-peers", "2")
        for name in ("a", "b"):
            assert swarm.wait_exit(name, 400) == 0, swarm.log(name)[-3000:]
        checkpoints = {name: swarm.checkpoint(name) for name in ("a", "b")}
        for name, partner in (("a", "b"), ("b", "a")):
            assert re.search(r"refresh of round 3: 2 shard ", swarm.log(name)), swarm.log(name)[-3000:]
            theirs = checkpoints[partner]
            assert (
                len(theirs.meta["shards"]) == 2
                and theirs.meta["round"] == checkpoints[name].meta["round"] == 3
            )
            for tensor_name, tensor in theirs.tensors.items():
                if (
                    ".mlp.shards." in tensor_name
                    and int(tensor_name.split(".mlp.shards.")[1].split(".")[0]) in theirs.meta["shards"]
                ):
                    mine = checkpoints[name].tensors[tensor_name].float()
                    torch.testing.assert_close(mine, tensor.float(), rtol=2e-3, atol=2e-4, msg=tensor_name)
    finally:
        swarm.close()
