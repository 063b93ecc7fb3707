"""What one commit tells the breaker and the timeline: `router/flows/handoff_outcome.py`."""

from __future__ import annotations

from pdserve.protocol.worker_api import HandoffInfo, TokenEvent
from pdserve.router.flows.handoff_outcome import Handoff, detail, of_commit


def _event(slow: bool | None) -> TokenEvent:
    info = None
    if slow is not None:
        info = HandoffInfo(transport="tcp", num_bytes=4096, seconds=1.5, slow=slow, canary="exact")
    return TokenEvent(token_ids=[7], handoff=info)


def test_a_commit_is_ok_unless_the_decode_side_says_it_was_slow() -> None:
    assert of_commit(_event(None)) == (Handoff.OK, "")
    assert of_commit(_event(False)) == (Handoff.OK, "")
    outcome, reason = of_commit(_event(True))
    assert outcome is Handoff.SLOW
    assert reason == "slow KV transfer over tcp: 4096 bytes in 1.500 s"


def test_the_timeline_line_names_transport_bytes_seconds_and_canary() -> None:
    assert detail(_event(None)) == ""
    assert detail(_event(False)) == "transport=tcp bytes=4096 seconds=1.5 canary=exact"
    assert detail(_event(True)).endswith(" SLOW")
