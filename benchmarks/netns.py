"""Nodes in network namespaces behind tbf-shaped links, and real byte counters on those links.

Layout: one Linux bridge in the root namespace (it carries the bootstrap DHT's address) and, per node, a
namespace connected to the bridge by a veth pair. With a rate, both ends of each pair get a `tc tbf` qdisc, so a
node's upload and its download are each limited to the rate, like an access link. The bridge-side end of a node's
pair sees every byte the node sends (its rx counter) and receives (its tx counter): `/sys/class/net` statistics in
the root namespace, read without entering the namespace. Needs root and iproute2.
"""

from __future__ import annotations

import logging
import random
import subprocess
import threading
import time
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (no root, no iproute2, a sandbox that forbids them)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _in_netns(ns: str) -> list[str]:
    """Prefix of a command line that runs it inside namespace `ns`."""
    return ["ip", "netns", "exec", ns]


def _run(*cmd: str, netns: str | None = None) -> str:
    """The output of `cmd`, run in namespace `netns` if given (CalledProcessError if it fails)."""
    prefix = [] if netns is None else _in_netns(netns)
    return subprocess.run([*prefix, *cmd], capture_output=True, text=True, check=True, timeout=30).stdout


def _tc(*args: str, netns: str | None = None) -> None:
    _run("tc", *args, netns=netns)


def check_available() -> None:
    """Raise NetnsUnavailable with the reason if a namespace and a veth pair cannot be made."""
    name = f"sbchk{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", name)
    except FileNotFoundError:
        raise NetnsUnavailable("iproute2 ('ip') is not installed") from None
    except subprocess.CalledProcessError as e:
        raise NetnsUnavailable(f"'ip netns add' failed: {e.stderr.strip()}") from None
    try:
        _ip("link", "add", f"{name}a", "type", "veth", "peer", "name", f"{name}b")
        _ip("link", "del", f"{name}a")
        subprocess.run(["tc", "-V"], capture_output=True, check=True, timeout=10)
    except FileNotFoundError:
        raise NetnsUnavailable("tc (iproute2) is not installed") from None
    except subprocess.CalledProcessError as e:
        raise NetnsUnavailable(f"cannot create a veth pair: {(e.stderr or '').strip()}") from None
    finally:
        _ip("netns", "del", name, check=False)


TBF_BURST = "64kb"
"""Default tbf bucket size: what a link may send at line rate after an idle moment."""
TBF_LATENCY = "50ms"
"""Default tbf queue: packets that would wait longer than this are dropped (a home router's buffer)."""


class ShapedNetwork:
    """A bridge plus `num_nodes` namespaces, each behind a veth pair shaped to `rate_mbit` (None: unshaped).

    `burst` and `latency` are tbf's: the bucket size and how long a packet may queue before it is dropped.
    `sysctls`: set in every namespace (the per-namespace ones: TCP's congestion control, buffer sizes, ...). A
    namespace other than the first may only pick a congestion control of `net.ipv4.tcp_allowed_congestion_control`."""

    def __init__(
        self,
        num_nodes: int,
        rate_mbit: float | None,
        *,
        burst: str = TBF_BURST,
        latency: str = TBF_LATENCY,
        sysctls: dict[str, str] | None = None,
    ):
        self.num_nodes, self.rate_mbit = num_nodes, rate_mbit
        self.sysctls = dict(sysctls or {})
        self.burst, self.latency = burst, latency
        self.tag = f"sb{uuid.uuid4().hex[:5]}"
        self.subnet = self._free_subnet()
        self.bridge = f"{self.tag}br"
        self._created_ns: list[str] = []
        self._created_links: list[str] = []

    @staticmethod
    def _free_subnet() -> str:
        used = _ip("-br", "addr").stdout
        for _ in range(100):
            subnet = f"10.{random.randint(128, 250)}.{random.randint(1, 250)}"
            if f" {subnet}." not in used:
                return subnet
        raise NetnsUnavailable("no free 10.x.y.0/24 subnet for the bridge")

    @property
    def host_ip(self) -> str:
        return f"{self.subnet}.1"

    def node_ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 2}"

    def namespace(self, i: int) -> str:
        return f"{self.tag}n{i}"

    def host_veth(self, i: int) -> str:
        return f"{self.tag}h{i}"

    def __enter__(self) -> ShapedNetwork:
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def setup(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created_links.append(self.bridge)
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.num_nodes):
            ns, host, inner = self.namespace(i), self.host_veth(i), f"{self.tag}p{i}"
            _ip("netns", "add", ns)
            self._created_ns.append(ns)
            _ip("link", "add", host, "type", "veth", "peer", "name", inner)
            self._created_links.append(host)
            _ip("link", "set", host, "master", self.bridge, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{self.node_ip(i)}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", self.host_ip)
            for key, value in self.sysctls.items():
                self._sysctl(ns, key, value)
            if self.rate_mbit:
                shape = ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", self.burst, "latency", self.latency]
                _tc("qdisc", "add", "dev", host, "root", *shape)
                _tc("qdisc", "add", "dev", inner, "root", *shape, netns=ns)

    def _sysctl(self, ns: str, key: str, value: str) -> None:
        try:
            _run("sysctl", "-w", f"{key}={value}", netns=ns)
        except subprocess.CalledProcessError as e:
            raise NetnsUnavailable(
                f"cannot set {key}={value} in a namespace: {(e.stderr or '').strip()}"
            ) from None

    def teardown(self) -> None:
        for ns in reversed(self._created_ns):
            _ip("netns", "del", ns, check=False)
        for link in reversed(self._created_links):
            _ip("link", "del", link, check=False)
        self._created_ns, self._created_links = [], []

    def exec_prefix(self, i: int) -> list[str]:
        """Prefix of a command line that runs it inside node i's namespace."""
        return _in_netns(self.namespace(i))

    def counters(self, i: int) -> tuple[int, int]:
        """(bytes node i sent, bytes node i received) so far, including headers: what crossed its link."""
        stats = Path("/sys/class/net") / self.host_veth(i) / "statistics"
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())

    def drop_connections(self, i: int, j: int) -> None:
        """Abort node i's TCP connections to node j (`ss -K`: the kernel resets them), as a path change would."""
        _run("ss", "-K", "dst", self.node_ip(j), netns=self.namespace(i))

    def tcp_segments(self, i: int) -> tuple[int, int]:
        """(TCP segments node i has sent, of which retransmitted) so far: its namespace's counters."""
        snmp = _run("cat", "/proc/net/snmp", netns=self.namespace(i))
        header, values = (line.split()[1:] for line in snmp.splitlines() if line.startswith("Tcp:"))
        tcp = dict(zip(header, values))
        return int(tcp["OutSegs"]), int(tcp["RetransSegs"])


class CounterSampler:
    """Samples every node's link counters `hz` times a second in a background thread."""

    def __init__(self, network: ShapedNetwork, hz: float = 20.0):
        self.network, self.period = network, 1.0 / hz
        self.samples: list[list[tuple[float, int, int]]] = [[] for _ in range(network.num_nodes)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-counters", daemon=True)

    def __enter__(self) -> CounterSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()

    def _sample(self) -> None:
        now = time.time()
        for i in range(self.network.num_nodes):
            try:
                sent, received = self.network.counters(i)
            except OSError:
                continue
            self.samples[i].append((now, sent, received))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period)
