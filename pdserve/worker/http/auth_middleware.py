"""The worker's check of the cluster credential on every control call (invariant 10).

Every request but the read-only `GET /health` and `GET /metrics` (load-balancer probes and
Prometheus scrapes cannot sign, and they change nothing) must carry a valid `X-Pdserve-Auth`
signature (`pdserve.auth.signing`): a missing one is refused with 401, a forged, stale or
replayed one with 403, one meant for an earlier life of this worker with 410 (StaleInstance),
before the handler runs, so a refused call leaves no state behind.
Without a verifier (a worker started with --insecure-no-auth) every call passes.

It knows aiohttp and the signing check; not the endpoints behind it.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pdserve.auth.signing import AUTH_HEADER, TARGET_HEADER, CallVerifier

OPEN: frozenset[tuple[str, str]] = frozenset({("GET", "/health"), ("GET", "/metrics")})


def auth_middleware(verifier: CallVerifier | None) -> Middleware:
    """Refuse calls without a valid cluster signature (raises Unauthenticated / Forbidden,
    which the error middleware renders as 401 / 403)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if verifier is not None and (request.method, request.path) not in OPEN:
            body = await request.read()
            target = request.headers.get(TARGET_HEADER)
            verifier.verify(
                request.headers.get(AUTH_HEADER), request.method, request.path, body, target
            )
        return await handler(request)

    return middleware
