"""Several "machines" on one Linux host: network namespaces joined by a bridge (`lab`).

    root namespace (this process)       namespace pd<pid>-switch        one namespace each
      pdv<pid>1  10.A.B.1/24  ── veth ──  bridge br0 ── veth ──  pd<pid>-<machine>  10.A.B.<n>/24
                                                     ── veth ──  ...

The bridge lives in a namespace of its own, not in the root one: where br_netfilter is loaded
(any Docker host), frames crossing a bridge go through that namespace's iptables FORWARD
chain, and Docker's sets DROP. A fresh namespace has no rules, so machine-to-machine traffic
(router to worker, prefill to decode) passes whatever the host's firewall says. The root
namespace is a machine on the bridge like the others, so this process reaches every process
directly, with no routing, forwarding or NAT.

Every name carries the process's pid and the lab's number in it, and the /24 is derived from
the pid and checked against the routes already present, so concurrent runs and labs neither
clash nor capture each other's traffic. A process runs on a machine through `Lab.wrap(name)` (`ip netns exec NS`, which
execs: its PID is the process's own, so it can be killed by PID). `unplug` takes a machine
off the bridge; `partition(a, b)` cuts two machines off from each other only (blackhole
routes: this kernel family may lack the qdiscs a packet filter needs, routes always exist),
`heal` undoes it. Leaving `lab` deletes every namespace, which destroys the bridge and every
veth pair with it, even when building the lab failed half way.

`probe_netns()` says why namespaces cannot be made here (not root, no `ip` (Debian package
iproute2), or the kernel / container refuses: tried, not guessed), None when they can. Used
by the multi-host tests and by the soak's partition fault (`pdserve chaos --soak`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

IP_MISSING = "`ip` is not on PATH (Debian: apt-get install iproute2)"
BRIDGE = "br0"  # inside the switch namespace, so the name cannot clash
_LABS = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


def probe_netns() -> str | None:
    """Why this process cannot build a `lab`, or None when it can (tried, not guessed)."""
    if shutil.which("ip") is None:
        return IP_MISSING
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"pdprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    try:
        bridged = _ip("-n", probe, "link", "add", BRIDGE, "type", "bridge", check=False)
        paired = _ip("link", "add", f"pdprb{os.getpid()}", "netns", probe, "type", "veth",
                     "peer", "name", "p0", "netns", probe, check=False)  # fmt: skip
    finally:
        _ip("netns", "del", probe, check=False)
    for step, done in (("a bridge", bridged), ("a veth pair", paired)):
        if done.returncode != 0:
            return f"cannot create {step} here: {done.stderr.strip()}"
    return None


def _free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0/13 that no route of this host overlaps, starting from `seed`."""
    taken: list[ipaddress.IPv4Network] = []
    for word in _ip("-4", "route", "show", "table", "all").stdout.split():
        with contextlib.suppress(ValueError):
            network = ipaddress.ip_network(word, strict=False)
            if isinstance(network, ipaddress.IPv4Network) and network.prefixlen > 0:
                taken.append(network)
    space = list(ipaddress.IPv4Network("10.200.0.0/13").subnets(new_prefix=24))
    for i in range(len(space)):
        candidate = space[(seed + i) % len(space)]
        if not any(candidate.overlaps(t) for t in taken):
            return candidate
    raise RuntimeError("no free /24 in 10.200.0.0/13 for the test bridge")


@dataclass(slots=True)
class Lab:
    """A switch namespace holding a bridge, and the machines (namespaces) plugged into it."""

    tag: str
    subnet: ipaddress.IPv4Network
    switch: str
    namespaces: dict[str, str] = field(default_factory=dict)  # machine -> namespace name
    addresses: dict[str, str] = field(default_factory=dict)  # machine -> IPv4 address
    ports: dict[str, str] = field(default_factory=dict)  # machine -> its bridge port
    devices: dict[str, str] = field(default_factory=dict)  # machine -> its end of the link

    def wrap(self, machine: str) -> list[str]:
        """The command prefix that runs a process on `machine`."""
        return ["ip", "netns", "exec", self.namespaces[machine]]

    def plug(self, namespace: str | None, index: int) -> str:
        """A veth pair from `namespace` (None: the root one) to the bridge, with address
        number `index` on the machine's end; returns that address."""
        # Unique names while both ends are still in the root namespace.
        end, port = f"pdv{self.tag}{index}", f"pds{self.tag}{index}"
        _ip("link", "add", end, "type", "veth", "peer", "name", port, "netns", self.switch)
        if namespace is not None:
            try:
                _ip("link", "set", end, "netns", namespace)
            except subprocess.CalledProcessError:
                _ip("link", "del", end, check=False)
                raise
        _ip("-n", self.switch, "link", "set", port, "master", BRIDGE, "up")
        on = ["-n", namespace] if namespace is not None else []
        address = str(self.subnet[index])
        _ip(*on, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", end)
        _ip(*on, "link", "set", end, "up")
        return address

    def add(self, machine: str) -> str:
        """A new namespace plugged into the bridge; returns its address."""
        index = len(self.namespaces) + 2  # .1 is the root namespace
        namespace = f"pd{self.tag}-{machine}"
        _ip("netns", "add", namespace)
        self.namespaces[machine] = namespace  # recorded first: close() removes it regardless
        _ip("-n", namespace, "link", "set", "lo", "up")
        self.addresses[machine] = self.plug(namespace, index)
        self.ports[machine] = f"pds{self.tag}{index}"
        self.devices[machine] = f"pdv{self.tag}{index}"
        return self.addresses[machine]

    def unplug(self, machine: str) -> None:
        """Take `machine`'s bridge port down: its packets vanish, nothing answers or resets,
        as when a machine loses power or its network. Its processes keep running."""
        _ip("-n", self.switch, "link", "set", self.ports[machine], "down")

    @property
    def root_address(self) -> str:
        """This (the root) namespace's address on the bridge."""
        return str(self.subnet[1])

    def partition(self, a: str, b: str) -> None:
        """Cut `a` and `b` off from each other, both ways, and from nobody else: each gets a
        blackhole route to the other (new connections fail at once with EINVAL, packets of
        open ones are dropped until `heal`)."""
        for here, there in ((a, b), (b, a)):
            _ip("-n", self.namespaces[here], "route", "add", "blackhole",
                f"{self.addresses[there]}/32")  # fmt: skip

    def heal(self, a: str, b: str) -> None:
        """Undo `partition(a, b)` (routes already gone are not an error)."""
        for here, there in ((a, b), (b, a)):
            _ip("-n", self.namespaces[here], "route", "del", "blackhole",
                f"{self.addresses[there]}/32", check=False)  # fmt: skip

    def close(self) -> list[str]:
        """Delete the machines and the switch (their veths and the bridge go with them);
        returns what could not be deleted."""
        errors = []
        # The root namespace's end first: the kernel dismantles deleted namespaces (and the
        # veths in them) asynchronously, and this one holds the subnet's route meanwhile.
        root_end = _ip("link", "del", f"pdv{self.tag}1", check=False)
        if root_end.returncode != 0 and "Cannot find device" not in root_end.stderr:
            errors.append(f"link del pdv{self.tag}1: {root_end.stderr.strip()}")
        for namespace in [*self.namespaces.values(), self.switch]:
            done = _ip("netns", "del", namespace, check=False)
            if done.returncode != 0:
                errors.append(f"netns del {namespace}: {done.stderr.strip()}")
        self.namespaces.clear()
        return errors


@contextlib.contextmanager
def lab(machines: Sequence[str]) -> Iterator[Lab]:
    """A bridge, the root namespace on it at .1, and one namespace per name in `machines`
    at .2, .3, ...; everything is removed on exit.

    Stop the processes running inside first: a namespace outlives `ip netns del` while a
    process is still in it (and keeps its address on the bridge)."""
    pid = os.getpid()
    # Labs of one process may overlap (a module's cluster and a test's own): each its names.
    tag = f"{pid}{next(_LABS)}"
    current = Lab(tag, _free_subnet(pid), f"pd{tag}-switch")
    _ip("netns", "add", current.switch)
    try:
        _ip("-n", current.switch, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", current.switch, "link", "set", BRIDGE, "up")
        current.plug(None, 1)
        for machine in machines:
            current.add(machine)
        yield current
    finally:
        errors = current.close()
        if errors:
            raise RuntimeError(f"network lab clean-up failed: {errors}")
