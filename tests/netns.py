"""A small multi-host network for tests: each host in its own network namespace, all joined by one bridge.

The bridge lives in the root namespace and holds the first address of a private /24 that the harness picks (one
that no interface or route of this machine uses), so the test process itself can run a bootstrap DHT there.
Each host gets a namespace, a veth pair (`eth0` inside, the other end on the bridge) and the next address. Links
are shaped in both directions with `tc ... tbf` (the egress of each end of the veth). `block_inbound` makes a
host unreachable the way a NAT or a stateful firewall does: it can open connections, but every connection
someone else opens to it dies at the handshake (its SYN-ACKs are dropped, inside its own namespace).
Nothing is installed and no traffic leaves the bridge; `close()` removes everything, also after a failure.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from swarm_utils import Swarm, launch, wait_for

from spes_node.swarm.swarm_key import SwarmKey

TBF_BURST = "32kbit"
TBF_LATENCY = "400ms"


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespace tests cannot run here, or None: needs root, iproute2, and a kernel that lets us build what
    the tests build (a namespace, a bridge, veth pairs, tbf and htb qdiscs, a u32 filter), tried in a throwaway
    namespace."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "ss"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"spes-probe-{os.getpid()}"
    made = run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` does not work here: {made.stderr.strip()}"
    ns = ("ip", "netns", "exec", probe)
    steps = [
        (*ns, "ip", "link", "add", "pbr", "type", "bridge"),
        (*ns, "ip", "link", "add", "pa", "type", "veth", "peer", "name", "pb"),
        (*ns, "tc", "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1mbit", "burst", TBF_BURST,
         "latency", TBF_LATENCY),
        (*ns, "tc", "qdisc", "add", "dev", "pb", "root", "handle", "1:", "htb", "default", "10"),
        (*ns, "tc", "class", "add", "dev", "pb", "parent", "1:", "classid", "1:20", "htb", "rate", "1mbit"),
        (*ns, "tc", "qdisc", "add", "dev", "pb", "parent", "1:20", "handle", "20:", "pfifo", "limit", "0"),
        (*ns, "tc", "filter", "add", "dev", "pb", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
         "u8", "0x12", "0x12", "at", "33", "flowid", "1:20"),
    ]  # fmt: skip
    try:
        for step in steps:
            done = run(*step, check=False)
            if done.returncode != 0:
                return f"`{' '.join(step[4:])}` fails here: {done.stderr.strip()}"
    finally:
        run("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    netns: str
    address: str
    veth: str
    """Our end of the pair, on the bridge; the host's end is `eth0` in its namespace."""

    def command(self, *args: str) -> list[str]:
        """`args` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *args]

    def maddr(self, port: int = 0) -> str:
        return f"/ip4/{self.address}/tcp/{port}"

    def listening_ports(self) -> list[int]:
        """TCP ports open on the host's own address (p2pd's, for a node)."""
        out = run(*self.command("ss", "-ltnH")).stdout
        return sorted(
            {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if self.address in line}
        )

    def connects(self, address: str, port: int) -> bool:
        """Whether a TCP connection from this host to `address:port` completes within a few seconds."""
        done = subprocess.run(self.command(sys.executable, "-c", _CONNECT, address, str(port)), timeout=30)
        return done.returncode == 0

    def accepted_from(self, other: Host) -> list[int]:
        """The ports of this host that take a connection from `other`, with a probe listener added on
        PROBE_PORT so that a host with no listener of its own cannot pass as unreachable."""
        with subprocess.Popen(self.command(sys.executable, "-c", _LISTEN, self.address)) as listener:
            try:
                wait_for(lambda: PROBE_PORT in self.listening_ports(), 30, "the probe listener")
                return [port for port in self.listening_ports() if other.connects(self.address, port)]
            finally:
                listener.kill()


PROBE_PORT = 9
_LISTEN = (
    "import socket, sys, time\n"
    f"s = socket.socket(); s.bind((sys.argv[1], {PROBE_PORT})); s.listen()\n"
    "time.sleep(60)\n"
)
_CONNECT = (
    "import socket, sys\n"
    "s = socket.socket(); s.settimeout(3)\n"
    "sys.exit(0 if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 1)\n"
)


class Network:
    """A bridge on a fresh private /24 and hosts added to it; use as a context manager or call `close()`."""

    def __init__(self) -> None:
        self.tag = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
        self.subnet = _free_subnet()
        self.bridge = f"spb{self.tag}"
        self.gateway = str(self.subnet.network_address + 1)
        self.hosts: dict[str, Host] = {}
        try:
            run("ip", "link", "add", self.bridge, "type", "bridge")
            run("ip", "addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            run("ip", "link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def maddr(self, port: int = 0) -> str:
        """A multiaddr on the bridge, for a peer that the test process runs itself."""
        return f"/ip4/{self.gateway}/tcp/{port}"

    def add_host(self, name: str, rate_mbit: float | None = None) -> Host:
        index = len(self.hosts) + 1
        host = Host(
            name=name,
            netns=f"spes-{self.tag}-{name}",
            address=str(self.subnet.network_address + 1 + index),
            veth=f"spv{self.tag}{index}",
        )
        self.hosts[name] = host
        inner = f"{host.veth}i"
        run("ip", "netns", "add", host.netns)
        run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", inner)
        run("ip", "link", "set", inner, "netns", host.netns)
        run("ip", "link", "set", host.veth, "master", self.bridge, "up")
        ns = ("ip", "netns", "exec", host.netns)
        run(*ns, "ip", "link", "set", inner, "name", "eth0")
        run(*ns, "ip", "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
        run(*ns, "ip", "link", "set", "eth0", "up")
        run(*ns, "ip", "link", "set", "lo", "up")
        run(*ns, "ip", "route", "add", "default", "via", self.gateway)
        if rate_mbit is not None:
            self.shape(host, rate_mbit)
        return host

    def shape(self, host: Host, rate_mbit: float) -> None:
        """Limit the host's link to `rate_mbit` in each direction."""
        tbf = ("tbf", "rate", f"{rate_mbit}mbit", "burst", TBF_BURST, "latency", TBF_LATENCY)
        run("tc", "qdisc", "replace", "dev", host.veth, "root", *tbf)
        run(*host.command("tc", "qdisc", "replace", "dev", "eth0", "root", *tbf))

    def block_inbound(self, host: Host, rate_mbit: float) -> None:
        """No connection into `host` completes; its own outgoing connections work. Its uplink is shaped with
        htb (tbf has no classes to filter into): SYN-ACKs (TCP flags byte: SYN and ACK set) go to a class that
        drops everything."""
        ns = host.command
        run(*ns("tc", "qdisc", "del", "dev", "eth0", "root"), check=False)
        run(*ns("tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10"))
        for classid in ("1:10", "1:20"):
            run(*ns("tc", "class", "add", "dev", "eth0", "parent", "1:", "classid", classid, "htb", "rate",
                    f"{rate_mbit}mbit"))  # fmt: skip
        run(
            *ns("tc", "qdisc", "add", "dev", "eth0", "parent", "1:20", "handle", "20:", "pfifo", "limit", "0")
        )
        # IPv4 header without options (20 bytes) + TCP flags at byte 13 of the TCP header = byte 33
        run(*ns("tc", "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                "match", "ip", "protocol", "6", "0xff", "match", "u8", "0x12", "0x12", "at", "33",
                "flowid", "1:20"))  # fmt: skip

    def close(self) -> None:
        for host in self.hosts.values():
            pids = run("ip", "netns", "pids", host.netns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
        for host in self.hosts.values():
            run("ip", "link", "del", host.veth, check=False)
            _delete_netns(host.netns)
        run("ip", "link", "del", self.bridge, check=False)
        self.hosts.clear()


def _delete_netns(name: str) -> None:
    for _ in range(20):
        if run("ip", "netns", "del", name, check=False).returncode == 0:
            return
        if name not in run("ip", "netns", "list", check=False).stdout:
            return
        time.sleep(0.25)


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no local address or route overlaps."""
    used = run("ip", "-4", "addr").stdout + run("ip", "-4", "route").stdout
    taken = [ipaddress.ip_network(word, strict=False) for word in used.split() if _looks_like_net(word)]
    for _ in range(1000):
        subnet = ipaddress.ip_network(f"10.{random.randrange(64, 250)}.{random.randrange(1, 250)}.0/24")
        if not any(subnet.overlaps(net) for net in taken):
            return subnet
    raise RuntimeError("no free private /24 for the test network")


def _looks_like_net(word: str) -> bool:
    try:
        ipaddress.ip_network(word, strict=False)
    except ValueError:
        return False
    return "." in word


class HostSwarm(Swarm):
    """`swarm_utils.Swarm` where nodes may run on `Host`s of a `Network` and the swarm may be private.

    The bootstrap DHT runs in the test process and listens on `bootstrap_maddr` (the bridge for a `Network`);
    with `swarm_key`, it and every node started with `key=True` hold the key (nodes read it from a file).
    """

    def __init__(
        self,
        tmp_path: Path,
        *,
        bootstrap_maddr: str = "/ip4/127.0.0.1/tcp/0",
        swarm_key: str | None = None,
        run_id: str = "t",
        **swarm_overrides,
    ):
        self.key = SwarmKey.from_text(swarm_key) if swarm_key else None
        self.key_file = Path(tmp_path) / "swarm.key" if swarm_key else None
        if self.key_file is not None:
            self.key_file.write_text(swarm_key)
            self.key_file.chmod(0o600)
        # as `spes-node dht` runs it: public reachability, so it is a circuit relay for NAT'd nodes from the start
        super().__init__(
            tmp_path, run_id, bootstrap_maddr=bootstrap_maddr, bootstrap_key=self.key, **swarm_overrides
        )

    def start(
        self,
        name: str,
        *args: str,
        host: Host | None = None,
        env: dict[str, str] | None = None,
        key: bool = True,
        node_dir: str | None = None,
        program: tuple[str, ...] = ("-m", "spes_node.cli"),
    ) -> subprocess.Popen:
        """Start node `name` (its log: `name`.log) with the checkpoint dir `node_dir` (default: `name`); `program`:
        what python runs (a test-only entry point, for example)."""
        self.keep_bootstrap()  # a node given a bootstrap without p2pd could not join
        node_dir = self.tmp / (node_dir or name)
        node_dir.mkdir(exist_ok=True)
        cmd = [
            sys.executable, *program, "join", "--run-id", self.run_id, "--peers", self.maddr,
            "--config", str(self.config_path), "--checkpoint-dir", str(node_dir), "--device", "cpu",
            "--host-maddrs", host.maddr() if host else "/ip4/127.0.0.1/tcp/0", "--public-name", name,
        ]  # fmt: skip
        if key and self.key_file is not None:
            cmd += ["--swarm-key-file", str(self.key_file)]
        if not any(arg in ("--shard", "--shards", "--max-shards") for arg in args):
            cmd += [
                "--shards",
                "1",
            ]  # as before shards by capacity: --shards auto would hold every tiny shard here
        cmd += list(args)
        proc = self.procs[name] = launch(host.command(*cmd) if host else cmd, self.tmp / f"{name}.log", env)
        return proc

    def close(self, names=None) -> None:
        for name in names or list(self.procs):
            if self.procs[name].poll() is None:
                self.crash(name)
        super().close(names)
