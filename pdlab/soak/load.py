"""The soak's clients: send every prepared request at its time, fail over between routers, record.

A single request is sent at its planned offset; a session's turns are sent in order, each no
earlier than its offset and `think_s` after the previous turn ended (successful or not: the
prompt is fixed in advance, see `soak_reference`). Nothing starts after the phase's window;
the whole phase is bounded by window + deadline + a margin, after which anything still open
is cancelled and recorded as past its deadline, so the load stops by itself.

Routers are tried as a load balancer would: a request goes to one router (single requests by
index, a session's turns alternating, so sessions change routers) and moves to the next one
only when the connection fails before any answer (refused, or reset before the headers); a
failure after the answer began is the request's outcome. Once a request has an id, the
router's timeline (`/debug/requests/{id}?workers=0`) names the workers it used, which the
checker needs for recovery times.

It talks to routers only (the public API), on loopback.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from pdlab.soak.history import Phase, RequestRecord
from pdlab.soak.reference import Prepared
from pdserve.advise.client import Completion, Ending, send

# Seconds past window + deadline after which a phase's load is cut short.
_MARGIN_S = 30.0
# Extra seconds the client waits past a request's deadline, so an overshoot is measured.
_CLIENT_SLACK_S = 20.0


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where the load goes, and how worker URLs map to names (for attribution)."""

    # (name, base URL) of each router, in order.
    routers: tuple[tuple[str, str], ...]
    # worker base URL -> worker name
    workers: dict[str, str]


class LoadRunner:
    """Runs one phase of prepared requests against the routers."""

    def __init__(
        self, session: aiohttp.ClientSession, endpoints: Endpoints, deadline_s: float
    ) -> None:
        self._session = session
        self._endpoints = endpoints
        self._deadline_s = deadline_s
        self._t0 = 0.0

    def _now(self) -> float:
        return asyncio.get_running_loop().time() - self._t0

    async def run(
        self, prepared: Sequence[Prepared], phase: Phase, window_s: float
    ) -> list[RequestRecord]:
        """Send what falls in `window_s` seconds from now; one record per request sent."""
        self._t0 = asyncio.get_running_loop().time()
        records: list[RequestRecord] = []
        sessions: dict[str, list[Prepared]] = {}
        singles: list[Prepared] = []
        for p in prepared:
            if p.planned.session is None:
                singles.append(p)
            else:
                sessions.setdefault(p.planned.session, []).append(p)
        tasks = [asyncio.create_task(self._single(p, phase, window_s, records)) for p in singles]
        tasks += [
            asyncio.create_task(self._session_turns(turns, phase, window_s, records))
            for turns in sessions.values()
        ]
        try:
            async with asyncio.timeout(window_s + self._deadline_s + _MARGIN_S):
                await asyncio.gather(*tasks)
        except TimeoutError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return sorted(records, key=lambda r: r.index)

    async def _single(
        self, p: Prepared, phase: Phase, window_s: float, records: list[RequestRecord]
    ) -> None:
        if p.planned.at_s >= window_s:
            return
        await asyncio.sleep(max(0.0, p.planned.at_s - self._now()))
        await self._send(p, phase, p.planned.index, records)

    async def _session_turns(
        self, turns: list[Prepared], phase: Phase, window_s: float, records: list[RequestRecord]
    ) -> None:
        ended = 0.0
        turns = sorted(turns, key=lambda t: t.planned.turn)
        for p in turns:
            start = max(p.planned.at_s, ended + p.planned.think_s if p.planned.turn else 0.0)
            if start >= window_s:
                return
            await asyncio.sleep(max(0.0, start - self._now()))
            # Turns alternate routers: a session must keep its worker across routers.
            await self._send(p, phase, turns[0].planned.index + p.planned.turn, records)
            ended = self._now()

    async def _send(
        self, p: Prepared, phase: Phase, first: int, records: list[RequestRecord]
    ) -> None:
        routers = self._endpoints.routers
        order = [routers[(first + k) % len(routers)] for k in range(len(routers))]
        start = self._now()
        tried: list[str] = []
        done: Completion | None = None
        try:
            for name, url in order:
                tried.append(name)
                done = await send(
                    self._session,
                    url,
                    p.path,
                    p.body,
                    stream=p.planned.stream,
                    timeout_s=self._deadline_s + _CLIENT_SLACK_S,
                    disconnect_after=p.planned.disconnect_after,
                )
                if done.ending is not Ending.UNREACHABLE:
                    break
        except asyncio.CancelledError:
            done = Completion(ending=Ending.TIMEOUT, error="timeout: the phase's load was cut")
            records.append(self._record(p, phase, start, self._now(), tried, done, ()))
            raise
        assert done is not None
        end = self._now()
        workers: tuple[str, ...] = ()
        if done.request_id and done.responded:
            workers = await self._workers_of(dict(routers)[tried[-1]], done.request_id)
        records.append(self._record(p, phase, start, end, tried, done, workers))

    async def _workers_of(self, router_url: str, request_id: str) -> tuple[str, ...]:
        """The workers the router's timeline names for the request (empty if unknown)."""
        try:
            async with self._session.get(
                f"{router_url}/debug/requests/{request_id}?workers=0",
                timeout=aiohttp.ClientTimeout(total=5),
            ) as resp:
                if resp.status != 200:
                    return ()
                history = json.loads(await resp.read())["history"]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            return ()
        details = " ".join(str(t.get("detail", "")) for t in history)
        return tuple(name for url, name in self._endpoints.workers.items() if url in details)

    def _record(
        self,
        p: Prepared,
        phase: Phase,
        start: float,
        end: float,
        tried: list[str],
        done: Completion,
        workers: tuple[str, ...],
    ) -> RequestRecord:
        r = p.planned
        return RequestRecord(
            phase=phase,
            index=r.index,
            api=r.api.value,
            stream=r.stream,
            deadline_s=self._deadline_s,
            session=r.session,
            turn=r.turn,
            malformed=r.malformed.value if r.malformed else None,
            disconnect_after=r.disconnect_after,
            expected_token_ids=p.expected_token_ids,
            expected_text=p.expected_text,
            expected_param=p.expected_param,
            start_s=round(start, 4),
            end_s=round(end, 4),
            ttft_s=done.ttft_s,
            routers=tuple(tried),
            status=done.status,
            request_id=done.request_id,
            token_ids=tuple(done.token_ids),
            text=done.text,
            finish_reason=done.finish_reason,
            ending=done.ending,
            error_type=done.error_type,
            error_param=done.error_param,
            error_message=done.error,
            workers=workers,
        )
