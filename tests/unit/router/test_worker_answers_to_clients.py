"""Whatever a worker answers, the client never gets a 500 or a 502: the recovery table absorbs
worker faults where it can, and what it cannot absorb is a 503 with Retry-After (or a 504 when
time ran out, a 400 when the request itself was wrong). Checked over every worker answer."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve.errors import NoCapacity, WorkerCallError, WorkerUnreachable
from pdserve.protocol.worker_api import ErrorBody
from pdserve.router.app import error_reply
from pdserve.router.flows.recovery import Phase, cause_of, classify

ERROR_TYPES = ("RequestNotFound", "NoCapacity", "KVNotReady", "LeaseExpired", "DeadlineExceeded",
               "PromptTooLong", "GrammarError", "InternalError", "FingerprintMismatch", "")  # fmt: skip
URL = "http://10.0.0.7:8101"
answers = st.one_of(
    st.builds(
        lambda status, kind, retryable, text: WorkerCallError(
            URL, status, ErrorBody(error=text, type=kind, retryable=retryable)
        ),
        st.integers(300, 599),
        st.sampled_from(ERROR_TYPES),
        st.booleans(),
        st.text(max_size=20),
    ),
    st.builds(lambda d: WorkerUnreachable(URL, d), st.text(max_size=20)),
)


@given(answers)
def test_no_worker_answer_reaches_a_client_as_500_or_502(exc: WorkerCallError) -> None:
    reply = error_reply(exc, 30.0)
    assert reply.status in (400, 503, 504), (reply, exc)
    if reply.status == 503:
        assert reply.extra.get("retry_after"), reply
    if reply.status == 400:
        assert isinstance(exc, WorkerCallError) and exc.status == 400
    # The worker's address stays inside the cluster (the router's log names it).
    assert "10.0.0.7" not in reply.message or "10.0.0.7" in str(exc).partition(URL)[2], reply


@given(answers, st.sampled_from([Phase.PREFILL, Phase.HANDOFF, Phase.DECODE, Phase.RESUME]))
def test_a_worker_that_lost_or_could_not_keep_the_request_is_recoverable(
    exc: WorkerCallError, phase: Phase
) -> None:
    """404 (state lost: an expired reservation or lease, a restart), unreachable, and every
    retryable refusal are failures the table answers, in every phase (a 400 is the request's
    own fault, whatever its flag says: every worker would refuse it)."""
    status = exc.status if isinstance(exc, WorkerCallError) else None
    if status != 400 and (status == 404 or exc.retryable):
        assert classify(phase, cause_of(exc)) is not None, (phase, exc)


def test_no_capacity_counts_the_workers_it_tried_without_naming_them() -> None:
    """The client learns how many workers were tried; the log and timeline keep which."""
    exc = NoCapacity("no decode worker left", tried={URL, "http://10.0.0.8:8101"})
    reply = error_reply(exc, 30.0)
    assert (reply.status, reply.extra) == (503, {"retry_after": "1"})
    assert reply.message == "no capacity: no decode worker left (2 workers tried)"
    assert URL in str(exc) and "10.0.0.8" in str(exc)
