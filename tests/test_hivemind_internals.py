"""The places where spes-node leans on hivemind internals, each checked against the installed hivemind: these
fail when an upgrade changes what the project relies on (relay flags, the robust reducer's copies, the command
pipe that carries bans)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.partition import TensorPartReducer
from hivemind.p2p import P2P

from spes_node.procs import NodeDHT, descendants
from spes_node.swarm import relay
from spes_node.swarm.bootstrap import start_bootstrap
from spes_node.swarm.robust import RobustPartReducer


@pytest.mark.swarm
def test_static_relays_reach_the_p2pd_command_line():
    bootstrap = start_bootstrap(["/ip4/127.0.0.1/tcp/0"])
    try:
        maddr = str(bootstrap.get_visible_maddrs()[0])
        # no initial peers: the flag is what is checked, and p2pd needs no connection to the relay to start
        dht = NodeDHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, **relay.dht_kwargs([maddr]))
        try:
            commands = [
                Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in descendants(dht.pid)
            ]
            p2pd = [c for c in commands if c and c[0].endswith(b"p2pd")]
            assert p2pd, "no p2pd below the DHT process"
            assert b"-relayDiscovery=0" in p2pd[0], p2pd[0]
            assert any(arg.startswith(b"-trustedRelays=") for arg in p2pd[0]), p2pd[0]
        finally:
            dht.shutdown()
    finally:
        bootstrap.shutdown()


def test_p2pd_arguments_are_built_where_the_relay_patch_hooks_in():
    source = inspect.getsource(P2P.create)
    assert "_make_process_args(" in source
    assert "autoRelay=" in source and '"trustedRelays"' in source


def test_the_robust_reducer_copies_match_the_hivemind_they_replace():
    # RobustPartReducer.accumulate_part re-implements hivemind's with one change (parts kept, not summed): the
    # attributes it uses must still exist with the same meaning
    hivemind_source = inspect.getsource(TensorPartReducer.accumulate_part)
    for name in ("current_part_index", "current_part_future", "num_parts_received", "sender_failed_after",
                 "current_part_accumulated_from", "check_current_part_finished", "finished"):  # fmt: skip
        assert name in hivemind_source or name in inspect.getsource(TensorPartReducer), name
    assert set(inspect.signature(RobustPartReducer.accumulate_part).parameters) == set(
        inspect.signature(TensorPartReducer.accumulate_part).parameters
    )
    # RobustAverager._run_allreduce_inplace_ replaces hivemind's, registering its runner the same way
    source = inspect.getsource(DecentralizedAverager._run_allreduce_inplace_)
    assert "self._running_groups[group_id].set_result(runner)" in source
    assert "tensor.add_(update, alpha=self._averaging_alpha)" in source


def test_bans_travel_on_the_averagers_command_pipe():
    # RobustAverager.set_banned sends ("_set_banned", args, kwargs) through hivemind's private pipe; the averager
    # process receives it and awaits getattr(self, method)(*args, **kwargs)
    assert "self._outer_pipe" in inspect.getsource(DecentralizedAverager.shutdown)
    run_internal = inspect.getsource(DecentralizedAverager._run_internal)
    assert "method, args, kwargs = self._inner_pipe.recv()" in run_internal
    assert "getattr(self, method)(*args, **kwargs)" in run_internal
