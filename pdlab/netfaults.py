"""Kernel-level network faults on a `netlab.Lab` machine: packet loss and a partition through
its packet filter (iptables, on INPUT: what arrives at the machine), and a rate limit through
its queueing discipline (tc tbf, on its bridge link: what leaves it).

    loss(m, share)     drop a random `share` of what arrives (TCP retransmits: slower, right)
    cut_off(m)         drop everything that arrives but the machine's own loopback, both ways
                       in effect (nothing reaches it; its connections stall, nothing resets)
    limit_rate(m, mb)  shape what leaves to `mb` Mbit/s
    restore(m)         undo all of these: the heal

The rules live in the machine's own namespace, so other machines and this host are untouched,
and deleting the namespace removes them. `probe_faults()` says why they cannot be applied here
(no iptables or tc, or the kernel refuses: tried in a throwaway namespace), None when they
can; the network fault tests skip with that reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from pdlab.netlab import Lab


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=10)


def probe_faults() -> str | None:
    """Why these faults cannot be applied here, or None when they can (tried, not guessed)."""
    for tool, package in (("iptables", "iptables"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH (Debian: apt-get install {package})"
    if os.geteuid() != 0:
        return "packet filters and queueing disciplines need root"
    probe = f"pdfprobe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    try:
        ns = ("ip", "netns", "exec", probe)
        tried = [
            _run(*ns, "iptables", "-A", "INPUT", "-m", "statistic", "--mode", "random",
                 "--probability", "0.5", "-j", "DROP", check=False),
            _run("ip", "-n", probe, "link", "add", "pdfp0", "type", "veth", "peer", "name",
                 "pdfp1", check=False),
            _run(*ns, "tc", "qdisc", "add", "dev", "pdfp0", "root", "tbf", "rate", "40mbit",
                 "burst", "32kbit", "latency", "400ms", check=False),
        ]  # fmt: skip
    finally:
        _run("ip", "netns", "del", probe, check=False)
    for what, done in zip(("an iptables rule", "a veth pair", "a tbf qdisc"), tried, strict=True):
        if done.returncode != 0:
            return f"cannot add {what} here: {done.stderr.strip()}"
    return None


def _iptables(lab: Lab, machine: str, *rule: str) -> None:
    _run(*lab.wrap(machine), "iptables", *rule)


def loss(lab: Lab, machine: str, share: float) -> None:
    """Drop a random `share` (0..1) of the packets arriving at `machine`."""
    _iptables(lab, machine, "-A", "INPUT", "-m", "statistic", "--mode", "random",
              "--probability", f"{share:.4f}", "-j", "DROP")  # fmt: skip


def cut_off(lab: Lab, machine: str) -> None:
    """Drop every packet arriving at `machine` from the network (its loopback still works)."""
    _iptables(lab, machine, "-A", "INPUT", "-i", "lo", "-j", "ACCEPT")
    _iptables(lab, machine, "-A", "INPUT", "-j", "DROP")


def limit_rate(lab: Lab, machine: str, mbit: float) -> None:
    """Shape what leaves `machine` onto the bridge to `mbit` Mbit/s."""
    _run("ip", "netns", "exec", lab.namespaces[machine], "tc", "qdisc", "replace", "dev",
         lab.devices[machine], "root", "tbf", "rate", f"{mbit}mbit", "burst", "32kbit",
         "latency", "400ms")  # fmt: skip


def restore(lab: Lab, machine: str) -> None:
    """Remove every fault on `machine` (rules flushed, shaping gone)."""
    _iptables(lab, machine, "-F", "INPUT")
    _run(*lab.wrap(machine), "tc", "qdisc", "del", "dev", lab.devices[machine], "root",
         check=False)  # fmt: skip
