"""The router's registration table and member-set diffs: listings, events, join order."""

from __future__ import annotations

import pytest

from pdserve.membership import Member, MemberDiff, MembershipError, diff_members
from pdserve.membership.codec import encode_member
from pdserve.membership.table import MemberTable, Row


def member(n: int, digest: str = "d") -> Member:
    return Member(f"http://w{n}:1", f"w{n}", "decode", digest, f"w{n}:2")


def row(n: int, create_revision: int, digest: str = "d") -> Row:
    return Row(f"/p/workers/w{n}".encode(), encode_member(member(n, digest)), create_revision)


def test_listing_is_ordered_by_create_revision_not_key() -> None:
    table = MemberTable()
    assert table.replace([row(1, 30), row(2, 10), row(3, 20)]) == []
    assert table.members() == [member(2), member(3), member(1)]


def test_put_and_delete_report_whether_the_set_changed() -> None:
    table = MemberTable()
    assert table.put(row(1, 5)) is True
    assert table.put(row(1, 5)) is False  # a repeated put (re-registration) changes nothing
    assert table.put(row(1, 5, digest="e")) is True
    assert table.members() == [member(1, "e")]
    assert table.delete(b"/p/workers/w1") is True
    assert table.delete(b"/p/workers/w1") is False
    assert table.members() == []


def test_an_undecodable_value_drops_the_key_and_names_it() -> None:
    table = MemberTable()
    table.put(row(1, 5))
    with pytest.raises(MembershipError, match=r"^key /p/workers/w1: registration value is not"):
        table.put(Row(b"/p/workers/w1", b"garbage", 5))
    assert table.members() == []


def test_replace_forgets_what_the_listing_lacks_and_collects_bad_rows() -> None:
    table = MemberTable()
    table.replace([row(1, 1), row(2, 2)])
    errors = table.replace([row(2, 2), Row(b"/p/workers/bad", b"{}", 3), row(4, 4)])
    assert [str(e).split(":")[0] for e in errors] == ["key /p/workers/bad"]
    assert table.members() == [member(2), member(4)]


def test_diff_by_url() -> None:
    a, b, c = member(1), member(2), member(3)
    b2 = Member(b.url, "w2-restarted", "decode", "d", b.transfer_address)
    assert diff_members([a, b], [b2, c]) == MemberDiff(added=(c,), removed=(a,), updated=(b2,))
    assert diff_members([a, b], [a, b]).empty
    assert diff_members([], [a]) == MemberDiff(added=(a,))


def test_diff_ignores_trailing_slashes_and_duplicate_urls() -> None:
    a = Member("http://h:1")
    assert diff_members([a], [Member("http://h:1/")]).empty
    first, second = Member("http://h:2", "x"), Member("http://h:2", "y")
    assert diff_members([], [first, second]) == MemberDiff(added=(first,))
