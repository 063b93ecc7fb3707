"""Transport attestation: every prefill/decode pair's KV path is probed when it forms.

A transport that quietly falls back (NIXL to TCP at 1% of its rate, separate PID namespaces
losing shared memory) still answers 200: only the rate shows it. So when a prefill or a decode
worker joins, or comes back as a new instance, the router probes each new pair it can form
(same fingerprint group, both healthy and not draining): the decode side expects throwaway
KV, the router signs that reservation as a handoff's, and the prefill side sends it over the
transport a handoff would use, timed (`worker/kv/probe.py`). The probe also opens the stream
later handoffs reuse, so the first request of a pair does not pay for the connection.

A pair below `SLOW_FRACTION` of its transport's expected rate (`protocol/kv_rates.py`), or
whose probe failed, is reported (router /health `kv_pairs`, `pdserve status`, a warning in the
log, `pdserve_router_kv_pair_gigabytes_per_second`) and steered around: placement prefers
another prefill worker for that decode worker. A probe is a KV transfer like a handoff's, so
the circuit breaker counts its outcome: a slow pair as a failed handoff (enough of them
re-colocate), a good one as a success. A probe that failed outright is not counted there (a
worker that went away is the health checks' business) and is taken again after `retry_s`.
Where no other pair exists, a slow one still serves: a request is never refused for it.

The choice of pairs is pure (`pairs_due`); `PairProber` runs it against the pool.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.errors import PdserveError, WorkerCallError
from pdserve.protocol.kv_rates import SLOW_FRACTION, expected_gbps, is_slow
from pdserve.protocol.reservation_signing import sign_reservation
from pdserve.protocol.worker_api import ProbeExpectRequest, ProbeResult, ProbeSendRequest
from pdserve.router.placement.policy import WorkerView
from pdserve.router.workers.client import WorkerClient
from pdserve.router.workers.pool import WorkerPool
from pdserve.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# (prefill url, its instance, decode url, its instance): a restart is a new pair.
PairKey = tuple[str, str, str, str]


class Verdict(enum.Enum):
    """What a pair's probe found (a metric label)."""

    OK = "ok"
    SLOW = "slow"  # far below its transport's expected rate
    FAILED = "failed"  # the probe's transfer did not complete
    # A worker that serves no probe (404: a build from before it); its pair is used unprobed.
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True, slots=True)
class PairProbe:
    """The last probe of one prefill/decode pair."""

    prefill: str
    decode: str
    verdict: Verdict
    transport: str = ""
    gbps: float = 0.0
    num_bytes: int = 0
    seconds: float = 0.0
    # The better transport the decode side offered that the pair could not use, and why.
    downgraded_from: str | None = None
    # Why it failed, or a sentence on the slow rate.
    detail: str = ""
    # When it was taken (the prober's clock): a failed probe is taken again later.
    at: float = 0.0

    @property
    def steer_around(self) -> bool:
        """Whether placement should prefer another pair."""
        return self.verdict in (Verdict.SLOW, Verdict.FAILED)


def _instance(view: WorkerView) -> str:
    return view.health.instance_id if view.health is not None else ""


def pair_key(prefill: WorkerView, decode: WorkerView) -> PairKey:
    """The pair as its processes are now (a restarted worker makes a new pair)."""
    return (prefill.url, _instance(prefill), decode.url, _instance(decode))


def pairs_due(
    views: Sequence[WorkerView], probed: Callable[[PairKey], bool]
) -> list[tuple[WorkerView, WorkerView]]:
    """Pairs to probe: a prefill-role worker and a decode candidate (role decode or both) of
    one fingerprint group, both healthy and not draining, not yet probed (`probed`) as the
    processes they are now. A pool with no prefill-role worker has no pairs to probe."""

    def live(v: WorkerView, roles: tuple[str, ...]) -> bool:
        return v.healthy and v.health is not None and not v.health.draining and v.role in roles

    prefills = [v for v in views if live(v, ("prefill",))]
    decodes = [v for v in views if live(v, ("decode", "both"))]
    due = []
    for d in decodes:
        assert d.health is not None
        for p in prefills:
            assert p.health is not None
            same_group = p.health.fingerprint_digest == d.health.fingerprint_digest
            if same_group and not probed(pair_key(p, d)):
                due.append((p, d))
    return due


def verdict_of(transport: str, num_bytes: int, seconds: float) -> tuple[Verdict, str]:
    """OK, or SLOW with a sentence saying how far below its transport the pair ran."""
    if not is_slow(transport, num_bytes, seconds):
        return Verdict.OK, ""
    gbps = num_bytes / seconds / 1e9
    want = expected_gbps(transport)
    return Verdict.SLOW, (
        f"{gbps:.2f} GB/s over {transport}, under {SLOW_FRACTION:.0%} of the {want:g} GB/s expected"
    )


class PairProber:
    """Probes the pairs `pairs_due` names, one at a time, every `interval_s`."""

    def __init__(
        self,
        pool: WorkerPool,
        client: WorkerClient,
        *,
        num_bytes: int,
        reservation_key: bytes | None,
        on_verdict: Callable[[PairProbe], None] | None = None,
        interval_s: float = 1.0,
        timeout_s: float = 30.0,
        retry_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._client = client
        self._num_bytes = num_bytes
        self._key = reservation_key
        # Told every verdict (the breaker counts the slow and failed ones).
        self._on_verdict = on_verdict
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._clock = clock
        self._probes: dict[PairKey, PairProbe] = {}
        self._task: asyncio.Task[None] | None = None
        self.num_probes = 0

    async def start(self) -> None:
        """Begin probing in the background."""
        self._task = asyncio.create_task(self._run(), name="pair-prober")

    async def stop(self) -> None:
        """Stop probing."""
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await self.probe_due()
            await asyncio.sleep(self._interval_s)

    async def probe_due(self) -> list[PairProbe]:
        """Probe every pair due now; their results."""
        done = []
        for prefill, decode in pairs_due(self._pool.snapshot(), self._settled):
            result = await self._probe(prefill.url, decode.url)
            self.num_probes += 1
            # Probes of pairs that no longer exist (a restart made a new one) are dropped.
            for key in [k for k in self._probes if k[0] == prefill.url and k[2] == decode.url]:
                del self._probes[key]
            self._probes[pair_key(prefill, decode)] = result
            done.append(result)
            if result.steer_around:
                log.warning(
                    "KV pair %s -> %s: %s (%s); placement prefers other pairs",
                    prefill.url,
                    decode.url,
                    result.verdict.value,
                    result.detail,
                )
            if self._on_verdict is not None:
                self._on_verdict(result)
        return done

    def _settled(self, key: PairKey) -> bool:
        probe = self._probes.get(key)
        if probe is None:
            return False
        return probe.verdict is not Verdict.FAILED or self._clock() - probe.at < self._retry_s

    async def _probe(self, prefill: str, decode: str) -> PairProbe:
        try:
            async with asyncio.timeout(self._timeout_s):
                # Twice, the second timed: the first pays for what only a pair's first
                # transfer does (a NIXL handshake, registrations, the scratch pages' faults).
                for _ in range(2):
                    got = await self._send_once(prefill, decode)
        except (PdserveError, TimeoutError, OSError) as exc:
            detail = f"{type(exc).__name__}: {exc}"[:300]
            unsupported = isinstance(exc, WorkerCallError) and exc.status == 404
            verdict = Verdict.UNSUPPORTED if unsupported else Verdict.FAILED
            return PairProbe(prefill, decode, verdict, detail=detail, at=self._clock())
        verdict, detail = verdict_of(got.transport, got.num_bytes, got.seconds)
        return PairProbe(
            prefill,
            decode,
            verdict,
            got.transport,
            got.num_bytes / got.seconds / 1e9 if got.seconds > 0 else 0.0,
            got.num_bytes,
            got.seconds,
            got.downgraded_from,
            detail,
            self._clock(),
        )

    async def _send_once(self, prefill: str, decode: str) -> ProbeResult:
        expect = ProbeExpectRequest(num_bytes=self._num_bytes, ttl_s=self._timeout_s)
        reservation = await self._client.probe_expect(decode, expect)
        signed = sign_reservation(self._key, reservation, decode, time.time() + self._timeout_s)
        send = ProbeSendRequest(reservation=signed, num_bytes=self._num_bytes)
        return await self._client.probe_send(prefill, send)

    def table(self) -> list[PairProbe]:
        """The last probe of every current pair, by prefill then decode URL."""
        return sorted(self._probes.values(), key=lambda p: (p.prefill, p.decode))

    def avoid(self, decode_url: str) -> set[str]:
        """Prefill workers whose pair with `decode_url` placement should not prefer."""
        return {
            p.prefill for p in self._probes.values() if p.decode == decode_url and p.steer_around
        }
