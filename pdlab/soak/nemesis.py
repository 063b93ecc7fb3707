"""The soak's nemesis: applies a planned fault list to a live, supervised cluster, and heals.

Each fault runs as its own task at its planned offset, so faults overlap as planned:
- kill (worker, router, etcd): SIGKILL by PID; over when the supervisor has it running
  again under a new PID (the supervisor, not the nemesis, brings it back);
- pause (worker, router): SIGSTOP by PID, SIGCONT after the duration (always, even when the
  run is cut short);
- corrupt / truncate / stall: the rules posted to the prefill worker's /admin/faults (through
  `WorkerClient`), cleared after the duration; the detail says how often they fired;
- partition: blackhole routes between two workers' network namespaces, removed after the
  duration; skipped, saying why, where the workers do not run in namespaces;
- loss / slow-link: 5% of the packets arriving at one worker's machine dropped (iptables), or
  its link shaped to 40 Mbit/s (tc), removed after the duration (`pdlab.netfaults`); skipped,
  saying why, without namespaces or where the kernel lacks the packet filter or the qdisc.
A fault whose target is not running at its time (still restarting from an earlier kill) is
recorded as skipped. Every fault is recorded (`FaultRecord`) with its start and end on the
soak's clock. `heal` undoes whatever may still be in effect; the soak calls it at the end
whatever happened. It signals only PIDs its cluster's supervisor started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Sequence

from pdlab import netfaults
from pdlab.netlab import Lab
from pdlab.soak.history import FaultRecord
from pdlab.soak.nemesis_plan import LINK_FAULTS, FaultKind, PlannedFault
from pdserve.errors import RouterError
from pdserve.protocol.worker_observe import FaultPlanBody
from pdserve.router.workers.client import WorkerClient
from pdserve.supervise.supervisor import ChildState, Supervisor

log = logging.getLogger(__name__)

_KILLS = frozenset({FaultKind.KILL_WORKER, FaultKind.KILL_ROUTER, FaultKind.ETCD_RESTART})
_PAUSES = frozenset({FaultKind.PAUSE_WORKER, FaultKind.PAUSE_ROUTER})
_TRANSFER = frozenset({FaultKind.CORRUPT, FaultKind.TRUNCATE, FaultKind.STALL})
# Seconds a killed process may take to be back before its fault is recorded as not healed.
_BACK_WITHIN_S = 90.0
# The link faults' strength: what TCP absorbs (loss), and far below any KV transport (rate).
LOSS_SHARE = 0.05
SLOW_LINK_MBIT = 40.0


class Nemesis:
    """Applies faults to one cluster (see the module docstring)."""

    def __init__(
        self,
        supervisor: Supervisor,
        client: WorkerClient,
        lab: Lab | None,
        lab_missing: str | None = None,
        seed: int = 0,
    ) -> None:
        self._sup = supervisor
        self._client = client
        self._lab = lab
        self._lab_missing = lab_missing or "the workers do not run in network namespaces"
        self._seed = seed
        self._t0 = 0.0
        self._paused: set[int] = set()
        self._partitions: set[tuple[str, str]] = set()
        # Machines carrying a link fault (loss, slow link) now.
        self._links: set[str] = set()
        self._planted: set[str] = set()

    def _now(self) -> float:
        return asyncio.get_running_loop().time() - self._t0

    async def run(self, plan: Sequence[PlannedFault], t0: float) -> list[FaultRecord]:
        """Apply every fault at `t0 + at_s` (loop time); returns their records in plan order."""
        self._t0 = t0
        tasks = [asyncio.create_task(self._at(f)) for f in plan]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await self.heal()

    async def _at(self, fault: PlannedFault) -> FaultRecord:
        await asyncio.sleep(max(0.0, fault.at_s - self._now()))
        try:
            return await self._apply(fault)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a fault that could not be applied is recorded, not fatal
            log.exception("fault %d (%s) failed", fault.index, fault.kind)
            return self._skipped(fault, f"could not apply: {type(exc).__name__}: {exc}")

    def _skipped(self, fault: PlannedFault, why: str) -> FaultRecord:
        return FaultRecord(fault.index, fault.kind.value, fault.targets, fault.at_s, False,
                           detail=why)  # fmt: skip

    def _running_pid(self, name: str) -> int | None:
        if self._sup.state(name) is not ChildState.RUNNING:
            return None
        return self._sup.pid(name)

    async def _apply(self, fault: PlannedFault) -> FaultRecord:
        kind = fault.kind
        if kind in _KILLS or kind in _PAUSES:
            name = fault.targets[0]
            pid = self._running_pid(name)
            if pid is None:
                return self._skipped(fault, f"{name} is not running ({self._sup.state(name)})")
            start = self._now()
            if kind in _KILLS:
                os.kill(pid, signal.SIGKILL)
                log.warning("nemesis: SIGKILL %s (pid %d)", name, pid)
                end = await self._back(name, pid)
                detail = f"pid {pid}" + ("" if end is not None else "; not back in time")
            else:
                self._paused.add(pid)
                os.kill(pid, signal.SIGSTOP)
                log.warning("nemesis: SIGSTOP %s (pid %d) for %.1f s", name, pid, fault.duration_s)
                try:
                    await asyncio.sleep(fault.duration_s)
                finally:
                    self._resume(pid)
                end, detail = self._now(), f"pid {pid}"
            return FaultRecord(fault.index, kind.value, fault.targets, fault.at_s, True, start,
                               end, detail)  # fmt: skip
        if kind in _TRANSFER:
            return await self._transfer(fault)
        if kind in LINK_FAULTS:
            return await self._link(fault)
        return await self._partition(fault)

    async def _back(self, name: str, old_pid: int) -> float | None:
        """When `name` runs again under a new PID (None if not within the limit)."""
        limit = self._now() + _BACK_WITHIN_S
        while self._now() < limit:
            pid = self._sup.pid(name)
            if self._sup.state(name) is ChildState.RUNNING and pid not in (None, old_pid):
                return self._now()
            if self._sup.state(name) is ChildState.GIVEN_UP:
                return None
            await asyncio.sleep(0.1)
        return None

    def _resume(self, pid: int) -> None:
        self._paused.discard(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    async def _transfer(self, fault: PlannedFault) -> FaultRecord:
        name = fault.targets[0]
        url = self._sup.url(name)
        if url is None or self._running_pid(name) is None:
            return self._skipped(fault, f"{name} is not running")
        start = self._now()
        plan = FaultPlanBody(rules=list(fault.rules), seed=self._seed * 1000 + fault.index)
        await self._client.set_faults(url, plan)
        self._planted.add(url)
        try:
            await asyncio.sleep(fault.duration_s)
        finally:
            fired = await self._clear(url)
        return FaultRecord(fault.index, fault.kind.value, fault.targets, fault.at_s, True, start,
                           self._now(), f"{fault.rules[0]}: fired {fired} times")  # fmt: skip

    async def _clear(self, url: str) -> str:
        """Clear a worker's plan; how often it fired ("?" if the worker did not answer)."""
        self._planted.discard(url)
        try:
            fired = (await self._client.faults(url)).num_injected
            await self._client.set_faults(url, FaultPlanBody(rules=[]))
            return str(fired)
        except RouterError:
            return "?"  # restarted meanwhile: its plan is gone with it

    async def _partition(self, fault: PlannedFault) -> FaultRecord:
        if self._lab is None:
            return self._skipped(fault, f"no partition: {self._lab_missing}")
        a, b = fault.targets
        start = self._now()
        await asyncio.to_thread(self._lab.partition, a, b)
        self._partitions.add((a, b))
        log.warning("nemesis: partition %s <-> %s for %.1f s", a, b, fault.duration_s)
        try:
            await asyncio.sleep(fault.duration_s)
        finally:
            self._partitions.discard((a, b))
            await asyncio.to_thread(self._lab.heal, a, b)
        return FaultRecord(fault.index, fault.kind.value, fault.targets, fault.at_s, True, start,
                           self._now(), "blackhole routes both ways")  # fmt: skip

    async def _link(self, fault: PlannedFault) -> FaultRecord:
        name = fault.targets[0]
        if self._lab is None or name not in self._lab.namespaces:
            return self._skipped(fault, f"no {fault.kind.value}: {self._lab_missing}")
        missing = await asyncio.to_thread(netfaults.probe_faults)
        if missing is not None:
            return self._skipped(fault, f"no {fault.kind.value}: {missing}")
        start = self._now()
        if fault.kind is FaultKind.LOSS:
            await asyncio.to_thread(netfaults.loss, self._lab, name, LOSS_SHARE)
            detail = f"{LOSS_SHARE:.0%} of arriving packets dropped"
        else:
            await asyncio.to_thread(netfaults.limit_rate, self._lab, name, SLOW_LINK_MBIT)
            detail = f"link shaped to {SLOW_LINK_MBIT:g} Mbit/s"
        self._links.add(name)
        log.warning("nemesis: %s on %s for %.1f s", fault.kind.value, name, fault.duration_s)
        try:
            await asyncio.sleep(fault.duration_s)
        finally:
            self._links.discard(name)
            await asyncio.to_thread(netfaults.restore, self._lab, name)
        return FaultRecord(fault.index, fault.kind.value, fault.targets, fault.at_s, True, start,
                           self._now(), detail)  # fmt: skip

    async def heal(self) -> None:
        """Undo whatever may still be in effect: paused processes, partitions, fault plans."""
        for pid in list(self._paused):
            self._resume(pid)
        if self._lab is not None:
            for a, b in list(self._partitions):
                await asyncio.to_thread(self._lab.heal, a, b)
            self._partitions.clear()
            for name in list(self._links):
                await asyncio.to_thread(netfaults.restore, self._lab, name)
            self._links.clear()
        for url in list(self._planted):
            await self._clear(url)
