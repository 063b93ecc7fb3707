"""The cluster secret every test process shares, and signed headers for direct worker calls.

`conftest.py` puts `TEST_SECRET` in the environment before any test runs, so every worker and
router a test starts (they read `PDSERVE_CLUSTER_SECRET`) belongs to one test cluster. Tests
that call a worker's control API directly sign their calls with `signed_headers`, exactly as
the router's `WorkerClient` does.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import yarl

from pdserve.auth.secret import ClusterSecret
from pdserve.auth.signing import auth_headers
from pdserve.protocol.reservation_signing import sign_reservation
from pdserve.protocol.worker_api import Reservation, SignedReservation

TEST_SECRET = "pdserve-test-cluster-secret-0123456789abcdef"
SECRET = ClusterSecret(TEST_SECRET.encode(), "tests")
HTTP_KEY = SECRET.key("http")


def signed_headers(method: str, path: str, body: bytes = b"") -> dict[str, str]:
    """Headers that sign one call to a worker of the test cluster (JSON content type)."""
    return {"Content-Type": "application/json", **auth_headers(HTTP_KEY, method, path, body)}


class SignedSession:
    """An aiohttp session whose calls carry the test cluster's signature (as the router's)."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.inner = session

    def _request(
        self, method: str, url: str, json_body: object = None, data: str | bytes | None = None
    ) -> Any:
        if json_body is not None:
            raw = json.dumps(json_body).encode()
        elif isinstance(data, str):
            raw = data.encode()
        else:
            raw = data or b""
        headers = signed_headers(method, yarl.URL(url).path, raw)
        return self.inner.request(method, url, data=raw or None, headers=headers)

    def post(self, url: str, json: object = None, data: str | bytes | None = None) -> Any:
        """POST, signed (`json` is serialized here so the signature covers its bytes)."""
        return self._request("POST", url, json, data)

    def get(self, url: str) -> Any:
        """GET, signed."""
        return self._request("GET", url)

    def delete(self, url: str) -> Any:
        """DELETE, signed."""
        return self._request("DELETE", url)


@contextlib.asynccontextmanager
async def signed_session(timeout: aiohttp.ClientTimeout) -> AsyncIterator[SignedSession]:
    """A `SignedSession` over a fresh aiohttp session."""
    async with aiohttp.ClientSession(timeout=timeout) as session:
        yield SignedSession(session)


def signed_reservation(
    reservation: dict[str, Any], decode_url: str | None = None, ttl_s: float = 300.0
) -> dict[str, Any]:
    """A decode worker's reservation as the router signs it for a prefill worker (JSON)."""
    signed = sign_reservation(
        SECRET.key("reservation"),
        Reservation.model_validate(reservation),
        decode_url,
        time.time() + ttl_s,
    )
    return signed.model_dump(mode="json")


def signed_model(
    reservation: Reservation, decode_url: str | None = None, ttl_s: float = 300.0
) -> SignedReservation:
    """`signed_reservation` as a protocol model."""
    return sign_reservation(SECRET.key("reservation"), reservation, decode_url, time.time() + ttl_s)
