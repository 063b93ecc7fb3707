"""Registration keys and values: exact bytes, round trips, and every rejected value."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdserve.errors import ConfigError
from pdserve.membership import Member, MembershipError
from pdserve.membership.base import UnsignedMember
from pdserve.membership.codec import (
    check_worker_id,
    decode_member,
    encode_member,
    worker_key,
    workers_prefix,
)
from pdserve.membership.table import MemberTable, Row

DECODE = Member("http://10.0.0.5:8101", "decode-0", "decode", "abc", "10.0.0.5:8102")


def test_keys() -> None:
    assert workers_prefix("/pdserve") == "/pdserve/workers/"
    assert worker_key("/a/b", "decode-0") == "/a/b/workers/decode-0"


@pytest.mark.parametrize("worker_id", ["", "a/b", "a b", "dé"])
def test_worker_ids_that_cannot_be_a_key_segment(worker_id: str) -> None:
    with pytest.raises(ConfigError, match=r"worker-id: .* must be non-empty"):
        check_worker_id(worker_id)


def test_encoding_is_sorted_compact_and_versioned() -> None:
    assert encode_member(DECODE) == (
        b'{"fingerprint_digest":"abc","instance_id":null,"mac":null,"role":"decode",'
        b'"transfer_address":"10.0.0.5:8102","url":"http://10.0.0.5:8101","version":1,'
        b'"worker_id":"decode-0"}'
    )


@pytest.mark.parametrize(
    "member",
    [
        DECODE,
        Member("http://h:1", "prefill-1", "prefill", "abc", None),
        Member("http://h:1", "prefill-1", "prefill", "abc", None, instance_id="9f1c2b"),
    ],
)
def test_round_trip(member: Member) -> None:
    assert decode_member(encode_member(member)) == member


def test_a_static_member_cannot_be_registered() -> None:
    with pytest.raises(MembershipError, match="without worker_id, role, fingerprint_digest"):
        encode_member(Member("http://h:1"))


def _value(**patch: object) -> bytes:
    body = json.loads(encode_member(DECODE))
    body.update(patch)
    return json.dumps({k: v for k, v in body.items() if v != "DROP"}).encode()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"\xff", "registration value is not JSON"),
        (b"{not json", "registration value is not JSON"),
        (b"[1]", "registration value is a list, not an object"),
        (_value(version=2), "registration version 2 is not supported"),
        (_value(version="DROP"), "registration version None is not supported"),
        (_value(role="DROP"), "registration field 'role': None is not a string"),
        (_value(worker_id=""), "registration field 'worker_id': '' is not a string"),
        (_value(url=5), "registration field 'url': 5 is not a string"),
        (_value(url="ftp://h"), "registration field 'url': 'ftp://h' is not an http"),
        (_value(transfer_address=7), "registration field 'transfer_address': 7"),
    ],
)
def test_invalid_values_are_refused_naming_the_field(value: bytes, message: str) -> None:
    with pytest.raises(MembershipError) as err:
        decode_member(value)
    assert str(err.value).startswith(message)


def test_decoding_drops_a_trailing_slash() -> None:
    assert decode_member(_value(url="http://h:1/")).url == "http://h:1"


# ---- signed registrations (issue 31 D4) ------------------------------------------------------

MEMBERSHIP_KEY = b"m" * 32


def test_a_signed_registration_round_trips_and_an_unsigned_one_is_refused() -> None:
    signed = Member("http://h:1", "prefill-1", "prefill", "abc", None, instance_id="9f")
    assert decode_member(encode_member(signed, MEMBERSHIP_KEY), MEMBERSHIP_KEY) == signed
    with pytest.raises(UnsignedMember, match="no MAC"):
        decode_member(encode_member(signed), MEMBERSHIP_KEY)
    with pytest.raises(UnsignedMember, match="does not match"):
        decode_member(encode_member(signed, b"k" * 32), MEMBERSHIP_KEY)


@pytest.mark.parametrize(
    "field", ["worker_id", "url", "role", "fingerprint_digest", "transfer_address", "instance_id"]
)
def test_every_trusted_field_is_under_the_mac(field: str) -> None:
    body = json.loads(encode_member(DECODE, MEMBERSHIP_KEY))
    body[field] = "http://evil:1" if field == "url" else "evil"
    with pytest.raises(UnsignedMember, match="does not match"):
        decode_member(json.dumps(body).encode(), MEMBERSHIP_KEY)


def test_the_table_drops_and_counts_unsigned_records() -> None:
    table = MemberTable(MEMBERSHIP_KEY)
    good = Row(b"/p/workers/decode-0", encode_member(DECODE, MEMBERSHIP_KEY), 1)
    forged = Row(b"/p/workers/evil", encode_member(replace(DECODE, worker_id="evil")), 2)
    assert table.replace([good, forged]) != []
    assert table.members() == [DECODE] and table.num_refused == 1
