"""Telling a decode worker that the KV it reserved for will not come (POST /kv_abort).

When a prefill worker gives a send up (attempts spent, a fatal refusal), the decode side would
otherwise wait until its reservation's lease ends, and the router with it: 30 s by default.
The notice goes over the control plane (HTTP), not the KV link, since a broken link is often
why the send failed. It is best effort: a notice that cannot be delivered changes nothing, and
the lease still frees the reservation.
"""

from __future__ import annotations

import logging

import aiohttp

from pdserve.auth.signing import auth_headers
from pdserve.protocol.worker_api import KVAbortRequest
from pdserve.worker.kv.outbox import Destination, GiveUpNotice

logger = logging.getLogger(__name__)

# The notice only saves waiting; it must not hold the sender's cleanup for long.
NOTICE_TIMEOUT_S = 2.0


def http_give_up_notice(session: aiohttp.ClientSession, key: bytes | None) -> GiveUpNotice:
    """A `GiveUpNotice` that posts /kv_abort to the destination's decode worker, signed with
    the cluster's control-call key."""

    async def notify(request_id: str, destination: Destination, reason: str) -> None:
        if destination.decode_url is None:
            return
        body = KVAbortRequest(
            request_id=request_id,
            transfer_id=destination.transfer_id.hex(),
            capability_token=destination.capability_token.hex(),
            reason=reason[:500],
        )
        data = body.model_dump_json().encode()
        headers = {"Content-Type": "application/json"}
        headers.update(auth_headers(key, "POST", "/kv_abort", data))
        try:
            async with session.post(
                f"{destination.decode_url}/kv_abort",
                data=data,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=NOTICE_TIMEOUT_S),
            ) as resp:
                if resp.status != 200:
                    logger.warning(
                        "kv_abort of %s at %s: HTTP %d: %s",
                        request_id,
                        destination.decode_url,
                        resp.status,
                        (await resp.text())[:200],
                    )
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("kv_abort of %s not delivered: %r", request_id, exc)

    return notify
