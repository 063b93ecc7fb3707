"""What the soak's nemesis does, drawn from one seed. Pure: no I/O, no clock.

A fault starts every `max_interval_s / 2` to `max_interval_s` seconds (so at least one per
`max_interval_s`), each a kind drawn from the enabled ones with a target drawn from the
cluster's shape, and most last seconds, so they overlap. The plan keeps one decode worker and
one router out of reach at any time: the targets measure failover, and a cluster with no
decode worker (or no router) left serves nobody whatever it does. Both prefill workers may be
down together: the decode workers then prefill locally. A killed process counts as busy for
the time it typically takes to come back; a prefill worker carries one transfer fault plan at
a time; one partition at a time; a worker under packet loss or a slow link carries nothing
else meanwhile. `nemesis.py` applies the plan.

The same seed, duration and shape give the same faults at the same offsets.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.errors import ConfigError


class FaultKind(enum.StrEnum):
    """What the nemesis can do (`--nemesis` names)."""

    KILL_WORKER = "kill-worker"
    KILL_ROUTER = "kill-router"
    PAUSE_WORKER = "pause-worker"
    PAUSE_ROUTER = "pause-router"
    CORRUPT = "corrupt"
    TRUNCATE = "truncate"
    STALL = "stall"
    PARTITION = "partition"
    ETCD_RESTART = "etcd-restart"
    # Kernel-level network faults on one worker's machine (pdlab.netfaults): a share of its
    # incoming packets dropped, or its outgoing link shaped to a crawl.
    LOSS = "loss"
    SLOW_LINK = "slow-link"


ALL_FAULTS: tuple[FaultKind, ...] = tuple(FaultKind)
_PROCESS_FAULTS = frozenset(
    {FaultKind.KILL_WORKER, FaultKind.PAUSE_WORKER, FaultKind.KILL_ROUTER, FaultKind.PAUSE_ROUTER}
)
_ROUTER_FAULTS = frozenset({FaultKind.KILL_ROUTER, FaultKind.PAUSE_ROUTER})
_PAUSES = frozenset({FaultKind.PAUSE_WORKER, FaultKind.PAUSE_ROUTER})
LINK_FAULTS = frozenset({FaultKind.LOSS, FaultKind.SLOW_LINK})


def parse_nemesis(text: str) -> tuple[FaultKind, ...]:
    """ "all" or a comma list of fault names; ConfigError naming the flag and the bad name."""
    if text.strip() == "all":
        return ALL_FAULTS
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ConfigError("--nemesis: no fault named (use all or a comma list)")
    kinds = []
    for name in names:
        try:
            kinds.append(FaultKind(name))
        except ValueError:
            known = ", ".join(k.value for k in FaultKind)
            raise ConfigError(f"--nemesis: unknown fault {name!r} (known: all, {known})") from None
    return tuple(dict.fromkeys(kinds))


@dataclass(frozen=True, slots=True)
class ClusterShape:
    """The names the nemesis may target."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    routers: tuple[str, ...]
    etcd: str | None = "etcd"


@dataclass(frozen=True, slots=True)
class PlannedFault:
    """One fault: when, what, on whom, for how long."""

    index: int
    at_s: float
    kind: FaultKind
    targets: tuple[str, ...]
    # How long a pause, partition or transfer fault lasts (0: a kill, instantaneous).
    duration_s: float = 0.0
    # Fault rules posted to the target's /admin/faults (transfer faults).
    rules: tuple[str, ...] = ()


# Seconds a killed process is typically away (restart backoff + start); the plan does not
# strike its group again meanwhile.
_AWAY_S = {FaultKind.KILL_WORKER: 12.0, FaultKind.KILL_ROUTER: 6.0, FaultKind.ETCD_RESTART: 6.0}
_TRANSFER_RULES = {
    FaultKind.CORRUPT: "transfer.send:corrupt:times=0,probability=0.5",
    FaultKind.TRUNCATE: "transfer.send:truncate:times=0,probability=0.3",
    FaultKind.STALL: "transfer.send:stall:times=0,probability=0.3",
}


def plan_faults(
    seed: int,
    duration_s: float,
    kinds: Sequence[FaultKind],
    shape: ClusterShape,
    max_interval_s: float = 8.0,
    first_at_s: float = 2.0,
) -> list[PlannedFault]:
    """The nemesis's faults for a soak of `duration_s` (see the module docstring)."""
    if max_interval_s <= 0:
        raise ConfigError(f"--fault-interval-s: must be > 0, got {max_interval_s}")
    rng = random.Random(f"pdserve-soak-nemesis:{seed}")
    # name -> until when it is out of reach (down, paused, or carrying a transfer fault)
    busy: dict[str, float] = {}
    # group -> until when one of its members is down or paused
    group_down: dict[str, float] = {}
    partition_until = 0.0
    groups = {"prefill": shape.prefill, "decode": shape.decode, "router": shape.routers}
    out: list[PlannedFault] = []
    t = first_at_s
    while t < duration_s and kinds:
        for kind in rng.sample(list(kinds), len(kinds)):
            fault = _draw(rng, kind, t, shape, groups, busy, group_down, partition_until)
            if fault is None:
                continue
            fault = PlannedFault(
                len(out), round(t, 3), fault.kind, fault.targets, fault.duration_s, fault.rules
            )
            out.append(fault)
            if kind is FaultKind.PARTITION:
                partition_until = t + fault.duration_s
            break
        t += rng.uniform(max_interval_s / 2, max_interval_s)
    return out


def _draw(
    rng: random.Random,
    kind: FaultKind,
    t: float,
    shape: ClusterShape,
    groups: dict[str, tuple[str, ...]],
    busy: dict[str, float],
    group_down: dict[str, float],
    partition_until: float,
) -> PlannedFault | None:
    """A fault of `kind` at `t` on free targets, recording what it occupies; None if none."""

    def free(name: str) -> bool:
        return busy.get(name, 0.0) <= t

    if kind in _PROCESS_FAULTS:
        members = [
            (group, n)
            for group in (("router",) if kind in _ROUTER_FAULTS else ("prefill", "decode"))
            if group == "prefill" or (len(groups[group]) > 1 and group_down.get(group, 0.0) <= t)
            for n in groups[group]
            if free(n)
        ]
        if not members:
            return None
        group, name = rng.choice(members)
        if kind in _PAUSES:
            duration, away = round(rng.uniform(1.0, 4.0), 3), 0.0
        else:
            duration, away = 0.0, _AWAY_S[kind]
        busy[name] = group_down[group] = t + duration + away + 1.0
        return PlannedFault(0, t, kind, (name,), duration)
    if kind in _TRANSFER_RULES:
        prefills = [n for n in shape.prefill if free(n)]
        if not prefills:
            return None
        name = rng.choice(prefills)
        duration = round(rng.uniform(3.0, 8.0), 3)
        busy[name] = t + duration
        return PlannedFault(0, t, kind, (name,), duration, (_TRANSFER_RULES[kind],))
    if kind in LINK_FAULTS:
        workers = [n for n in (*shape.prefill, *shape.decode) if free(n)]
        if not workers:
            return None
        name = rng.choice(workers)
        duration = round(rng.uniform(3.0, 8.0), 3)
        busy[name] = t + duration
        return PlannedFault(0, t, kind, (name,), duration)
    if kind is FaultKind.PARTITION:
        pairs = [(p, d) for p in shape.prefill for d in shape.decode if free(p) and free(d)]
        if not pairs or partition_until > t:
            return None
        pair = rng.choice(pairs)
        return PlannedFault(0, t, kind, pair, round(rng.uniform(2.0, 6.0), 3))
    if kind is FaultKind.ETCD_RESTART and shape.etcd is not None and free(shape.etcd):
        busy[shape.etcd] = t + _AWAY_S[kind]
        return PlannedFault(0, t, kind, (shape.etcd,))
    return None
