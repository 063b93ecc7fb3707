"""Reservations the router vouches for: signing them, and checking them before any prefill.

A prefill worker sends KV wherever a reservation points. So that it never sends KV to an
address it was merely told about (any caller could name one), the router signs each
reservation it obtained from a decode worker, together with that worker's control URL and an
expiry, with the cluster secret's "reservation" key; the prefill worker checks the signature,
the expiry and the format version before it spends a prefill (`Forbidden` / `ConfigError`
otherwise, nothing started). Pure: time comes in as an argument.
"""

from __future__ import annotations

import hmac

from pdserve.auth.signing import mac_fields
from pdserve.errors import ConfigError, Forbidden
from pdserve.protocol.worker_api import RESERVATION_VERSION, Reservation, SignedReservation

RESERVATION_KEY = "reservation"


def _mac(key: bytes, reservation: Reservation, decode_url: str | None, expires_at_s: float) -> str:
    return mac_fields(key, reservation.model_dump_json(), decode_url, expires_at_s)


def sign_reservation(
    key: bytes | None, reservation: Reservation, decode_url: str | None, expires_at_s: float
) -> SignedReservation:
    """The reservation with the router's signature ("" without a key: an insecure cluster)."""
    signature = "" if key is None else _mac(key, reservation, decode_url, expires_at_s)
    return SignedReservation(
        reservation=reservation,
        decode_url=decode_url,
        expires_at_s=expires_at_s,
        signature=signature,
    )


def verify_reservation(key: bytes | None, signed: SignedReservation, now_s: float) -> None:
    """Return if the reservation may be sent to; raise Forbidden (signature, expiry) or
    ConfigError (a format version this build does not speak) naming what failed."""
    reservation = signed.reservation
    if reservation.version != RESERVATION_VERSION:
        raise ConfigError(
            f"reservation.version: {reservation.version} is not spoken here"
            f" ({RESERVATION_VERSION} is)"
        )
    if key is None:
        return
    want = _mac(key, reservation, signed.decode_url, signed.expires_at_s)
    if not hmac.compare_digest(want, signed.signature):
        raise Forbidden(
            f"reservation of {reservation.request_id}: signature does not match (not issued by"
            " this cluster's router, or altered)"
        )
    if now_s > signed.expires_at_s:
        raise Forbidden(
            f"reservation of {reservation.request_id}: expired {now_s - signed.expires_at_s:.1f}"
            " s ago"
        )
