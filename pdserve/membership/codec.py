"""Registration keys and values in etcd. Pure: strings and bytes in, `Member`s out.

Layout: one key per worker, `<prefix>/workers/<worker_id>`, attached to the worker's lease,
whose value is a JSON object (sorted keys, versioned):

    {"version": 1, "worker_id": "decode-0", "url": "http://10.0.0.5:8101", "role": "decode",
     "fingerprint_digest": "…", "transfer_address": "10.0.0.5:8102",
     "instance_id": "9f1c…"}

`instance_id` (optional, as `transfer_address` is) names the process's life: a worker that
restarts at the same address registers a new one.

With the cluster secret, the value also carries `"mac"`: HMAC-SHA256 (the secret's
"membership" key) over every field a router trusts, so write access to etcd alone cannot add
a worker that then receives prompts; a router with the secret ignores (and counts) a value
without a matching MAC.

A reader rejects a value it cannot trust (not JSON, unknown version, a field missing or of
the wrong type) with a MembershipError naming the field, and never guesses.
"""

from __future__ import annotations

import hmac
import json
import re
from dataclasses import replace

from pdserve.auth.signing import mac_fields
from pdserve.errors import ConfigError
from pdserve.membership.base import Member, MembershipError, UnsignedMember

VALUE_VERSION = 1
# A worker id is one key segment; etcdctl users can type it unquoted.
_WORKER_ID_RE = re.compile(r"[A-Za-z0-9._-]+")
_REQUIRED = ("worker_id", "url", "role", "fingerprint_digest")


def check_worker_id(worker_id: str) -> str:
    """`worker_id` if it can be a key segment; ConfigError naming it otherwise."""
    if not _WORKER_ID_RE.fullmatch(worker_id):
        raise ConfigError(
            f"worker-id: {worker_id!r} must be non-empty and use only [A-Za-z0-9._-]"
            " (it is a key in the membership store)"
        )
    return worker_id


def workers_prefix(prefix: str) -> str:
    """The key range every worker of the cluster under `prefix` registers in."""
    return f"{prefix}/workers/"


def worker_key(prefix: str, worker_id: str) -> str:
    """The key of one worker's registration."""
    return workers_prefix(prefix) + check_worker_id(worker_id)


def member_mac(key: bytes, member: Member) -> str:
    """The MAC a registration carries: every field a router trusts, under the cluster secret's
    "membership" key."""
    return mac_fields(
        key,
        "pdserve-member",
        VALUE_VERSION,
        member.worker_id,
        member.url,
        member.role,
        member.fingerprint_digest,
        member.transfer_address,
        member.instance_id,
    )


def encode_member(member: Member, key: bytes | None = None) -> bytes:
    """A registered worker's value, signed with `key` when given; every field but
    transfer_address and instance_id must be set."""
    missing = [name for name in _REQUIRED if getattr(member, name) is None]
    if missing:
        raise MembershipError(f"member {member.url}: cannot register without {', '.join(missing)}")
    body = {
        "mac": None if key is None else member_mac(key, member),
        "version": VALUE_VERSION,
        "worker_id": member.worker_id,
        "url": member.url,
        "role": member.role,
        "fingerprint_digest": member.fingerprint_digest,
        "transfer_address": member.transfer_address,
        "instance_id": member.instance_id,
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def decode_member(value: bytes, key: bytes | None = None) -> Member:
    """The member a registration value describes; MembershipError if it is not valid, and
    UnsignedMember if `key` is given and the value carries no matching MAC."""
    try:
        body = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MembershipError(f"registration value is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise MembershipError(f"registration value is a {type(body).__name__}, not an object")
    if body.get("version") != VALUE_VERSION:
        raise MembershipError(
            f"registration version {body.get('version')!r} is not supported"
            f" (this build reads {VALUE_VERSION})"
        )
    for name in _REQUIRED:
        if not isinstance(body.get(name), str) or not body[name]:
            raise MembershipError(
                f"registration field {name!r}: {body.get(name)!r} is not a string"
            )
    if not body["url"].startswith(("http://", "https://")):
        raise MembershipError(f"registration field 'url': {body['url']!r} is not an http(s) URL")
    optional = {name: body.get(name) for name in ("transfer_address", "instance_id")}
    for name, found in optional.items():
        if found is not None and not isinstance(found, str):
            raise MembershipError(f"registration field {name!r}: {found!r} is not a string")
    member = Member(
        url=body["url"],
        worker_id=body["worker_id"],
        role=body["role"],
        fingerprint_digest=body["fingerprint_digest"],
        transfer_address=optional["transfer_address"],
        instance_id=optional["instance_id"],
    )
    if key is not None:
        mac = body.get("mac")
        if not isinstance(mac, str) or not mac.isascii():
            raise UnsignedMember(f"registration of {member.worker_id}: no MAC (unsigned)")
        if not hmac.compare_digest(mac, member_mac(key, member)):
            raise UnsignedMember(
                f"registration of {member.worker_id}: MAC does not match (not signed with"
                " this cluster's secret, or altered)"
            )
    return replace(member, url=member.url.rstrip("/"))
