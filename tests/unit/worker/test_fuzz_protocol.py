"""Fuzz: random JSON against the worker protocol (`protocol/worker_api.py`), its models and a real
worker's control API in-process.

What is fuzzed:
- Every request model of the protocol gets random JSON documents and valid bodies with fields
  replaced (wrong types, huge and negative numbers, NaN and infinities, lone surrogates, long
  strings, nested junk), removed, or joined by unknown fields.
- Two real `Worker`s in this process (a prefill and a decode worker: the tiny model, the
  cluster secret, TCP KV) get sequences of 1 to 4 signed calls to /reserve, /prefill,
  /decode, /generate, /release, /renew and /kv_abort over a small pool of request ids, now and
  then at the worker of the other role. Half the examples follow the disaggregated flow
  (reserve, prefill, decode, each call mostly valid), where the /prefill carries the
  reservation the /reserve returned, fields edited before the router's signature is put on
  it, so the prefill worker really sends the KV to the decode worker.

Properties: a model validates or raises pydantic's ValidationError, which the worker renders as
a 400 `ErrorBody` naming the field. Every call gets 200 with a valid body (NDJSON token events
with one `finished` event last) or a 4xx/503/504 `ErrorBody` whose type is a `pdserve.errors`
class or ValidationError: never a 5xx from an unexpected error, and nothing is logged as one
(handlers, background sends, the engine step, the lease reaper). A stream that is still running
after `STREAM_BUDGET_S` is left by the client (a disconnect the worker must clean up). After each
example every request id is released, and then no lease, reservation, held or pinned block,
running or waiting request, or KV send is left.

Budget: 150 model examples, 60 worker examples, fixed seed (`fuzz_support`): about
2 s of CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pydantic
import pytest
from cluster_auth import SECRET, signed_headers, signed_reservation
from fuzz_support import (
    fuzz_settings,
    header_values,
    json_values,
    lone_surrogates,
    note,
    one_in,
    raw_request,
)
from hypothesis import Phase, example, given
from hypothesis import strategies as st

from pdserve import errors
from pdserve.clock import FakeClock
from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.engine.sampler import draw_key
from pdserve.protocol import worker_api as protocol
from pdserve.protocol.sampling import SamplingParams
from pdserve.worker.config import WorkerConfig
from pdserve.worker.http.error_status import error_response
from pdserve.worker.lease_keeper import LeaseKeeper
from pdserve.worker.server import Worker

STREAM_BUDGET_S = 1.0
CALL_TIMEOUT_S = 20.0
SETTLE_TIMEOUT_S = 20.0
RIDS = ("fz-0", "fz-1", "fz-2")

REQUESTS: dict[str, type[pydantic.BaseModel]] = {
    "/reserve": protocol.ReserveRequest,
    "/prefill": protocol.PrefillRequest,
    "/decode": protocol.DecodeRequest,
    "/generate": protocol.GenerateRequest,
    "/release": protocol.ReleaseRequest,
    "/renew": protocol.RenewRequest,
    "/kv_abort": protocol.KVAbortRequest,
}
RESPONSES: dict[str, type[pydantic.BaseModel]] = {
    "/reserve": protocol.Reservation,
    "/prefill": protocol.PrefillResult,
    "/release": protocol.ReleaseResult,
    "/renew": protocol.RenewResult,
    "/kv_abort": protocol.KVAbortResult,
}
STREAMED = ("/decode", "/generate")
ROLES = ("prefill", "decode")
ROLE_OF = {path: "prefill" if path == "/prefill" else "decode" for path in REQUESTS}
SAMPLING = {"max_tokens": 1, "temperature": 0}


def valid_body(path: str, rid: str) -> dict[str, Any]:
    """A body the worker accepts (given the right state), cheap to serve."""
    prompt = [1, 2, 3, 4, 5]
    return {
        "/reserve": {"request_id": rid, "prompt_token_ids": prompt, "sampling": SAMPLING,
                     "lease_ttl_s": 2.0},
        "/prefill": {"request_id": rid, "prompt_token_ids": prompt, "sampling": SAMPLING,
                     "lease_ttl_s": 2.0, "deadline_s": 5.0},
        "/decode": {"request_id": rid, "first_token_id": 5, "kv_timeout_s": 0.3,
                    "deadline_s": 1.0},
        "/generate": {"request_id": rid, "prompt_token_ids": prompt, "sampling": SAMPLING,
                      "deadline_s": 1.0},
        "/release": {"request_id": rid},
        "/renew": {"request_id": rid},
        "/kv_abort": {"request_id": rid, "transfer_id": "00" * 16, "capability_token": "11" * 16,
                      "reason": "fuzz"},
    }[path]  # fmt: skip


# ---- field values ------------------------------------------------------------------------------

durations = st.sampled_from([1e-9, 0.05, 0.3, 1e308, float("inf"), 0, -1.0, "1", None])
token_lists = st.one_of(
    st.sampled_from([[], [0], [2047], [2048], [-1], [10**30], [1, True], [1] * 3000]),
    st.lists(st.integers(0, 2047), max_size=6),
)
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "request_id": st.one_of(st.sampled_from([*RIDS, "", "\0", "é" * 300]), lone_surrogates),
    "prompt_token_ids": token_lists,
    "output_token_ids": token_lists,
    "first_token_id": st.sampled_from([-1, 0, 5, 2047, 2048, 10**30]),
    "lease_ttl_s": durations,
    "deadline_s": durations,
    "kv_timeout_s": durations,
    "transfer_attempts": st.sampled_from([0, 1, 2, 101, 10**30]),
    "transfer_id": st.sampled_from(["", "zz", "00" * 16, "0" * 31, "ab" * 64]),
    "capability_token": st.sampled_from(["", "zz", "11" * 16, "1" * 33]),
    "reason": st.sampled_from(["", "x" * 5000]),
    "max_tokens": st.sampled_from([-1, 0, 1, 2, 2047, 10**20]),
    "temperature": st.sampled_from([0, 0.7, 1e-300, 5e-324, -1, 1e308]),
    "top_k": st.sampled_from([-2, -1, 0, 1, 10**20]),
    "top_p": st.sampled_from([0, 5e-324, 0.5, 1, 1.5]),
    "seed": st.sampled_from([-1, 0, 2**64 - 1, 2**64, 10**30]),
    "stop": st.sampled_from([[], [""], ["x"], ["x" * 3000], "x"]),
    "stop_token_ids": st.sampled_from([[], [-1], [0], [10**30]]),
    "ignore_eos": st.sampled_from([True, False, "x"]),
}
PLAUSIBLE.update(
    {  # the fields of a reservation
        "version": st.sampled_from([0, 1, 3, 10**30]),
        "lease_epoch": st.sampled_from([-1, 0, 1, 2**64 - 1, 2**64, 10**30]),
        "num_cached_tokens": st.sampled_from([-1, 0, 16, 10**30]),
        "endpoints": st.sampled_from(
            [
                [],
                [{"transport": "tcp", "address": "127.0.0.1:1"}],
                [{"transport": "tcp", "address": "nowhere"}],
                [{"transport": "smoke", "address": ""}],
                [{"transport": "tcp", "address": "[::1]:99999"}],
            ]
        ),
    }
)


def edit(draw: st.DrawFn, body: dict[str, Any], model: type[pydantic.BaseModel]) -> None:
    """Replace (with a plausible value or random JSON) or remove one field of `body`, a
    `model`, or one of its sampling parameters; or add an unknown field."""
    target, names = body, list(model.model_fields)
    if "sampling" in body and isinstance(body["sampling"], dict) and draw(st.booleans()):
        target = body["sampling"] = dict(body["sampling"])
        names = [f.name for f in dataclasses.fields(SamplingParams)]
    name = draw(st.sampled_from([*names, "bogus"]))
    action = draw(st.sampled_from(["plausible", "plausible", "random", "remove"]))
    if action == "remove":
        target.pop(name, None)
    elif action == "plausible" and name in PLAUSIBLE:
        target[name] = draw(PLAUSIBLE[name])
    else:
        target[name] = draw(json_values)


# ---- the models --------------------------------------------------------------------------------


@st.composite
def model_inputs(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(REQUESTS)))
    if draw(one_in(4)):
        return path, json.dumps(draw(json_values)).encode()
    body = valid_body(path, draw(st.sampled_from(RIDS)))
    for _ in range(draw(st.integers(1, 3))):
        edit(draw, body, REQUESTS[path])
    return path, json.dumps(body).encode()


def floats_in(value: object) -> Iterator[float]:
    """Every float in a dumped model (nested dicts and lists)."""
    if isinstance(value, float):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from floats_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from floats_in(item)


@fuzz_settings(150)
@given(model_inputs())
@example(
    (
        "/reserve",
        b'{"request_id": "r", "prompt_token_ids": [1], "sampling": {}, "lease_ttl_s": Infinity}',
    )
)
@example(
    (
        "/generate",
        b'{"request_id": "r", "prompt_token_ids": [1], "sampling": {"seed": 18446744073709551616}}',
    )
)
def test_protocol_models_validate_or_refuse_with_a_400_naming_the_field(
    case: tuple[str, bytes],
) -> None:
    path, raw = case
    model = REQUESTS[path]
    try:
        parsed = model.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        response = error_response(exc, "fuzz")
        assert response.status == 400
        assert response.text is not None
        body = protocol.ErrorBody.model_validate_json(response.text)
        first = exc.errors()[0]["loc"]
        assert body.type == "ValidationError"
        assert (str(first[0]) if first else "body") in body.error
        note(f"refused: {first[0] if first else 'body'}")
        return
    # Durations reach leases and deadlines: a model that parsed holds only finite numbers.
    assert all(math.isfinite(x) for x in floats_in(parsed.model_dump())), parsed
    sampling = getattr(parsed, "sampling", None)
    if isinstance(sampling, SamplingParams):
        draw_key(sampling.seed or 0, 0)  # what the protocol accepts, the sampler can serve
    note(f"valid {model.__name__}")


# ---- a real worker -----------------------------------------------------------------------------


class Untyped(logging.Handler):
    """Collects what the worker logs about failures it did not expect (an untyped error)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        typed = {n for n in dir(errors) if isinstance(getattr(errors, n), type)}
        names = [a for a in record.args or () if isinstance(a, str)]
        send_failed = record.name.endswith("kv_outbox") and "failed" in record.msg
        if (
            record.exc_info
            or record.levelno >= logging.ERROR
            or (send_failed and not any(n in typed for n in names))
        ):
            self.records.append(f"{record.name}: {record.getMessage()}")


@dataclass
class Node:
    """The workers under test (a prefill and a decode worker), their loop, a client session
    and the log watch."""

    loop: asyncio.AbstractEventLoop
    workers: dict[str, Worker]
    session: aiohttp.ClientSession
    untyped: Untyped
    num_blocks: dict[str, int] = field(default_factory=dict)

    def url(self, role: str) -> str:
        url = self.workers[role].url
        assert url is not None
        return url


def worker_config(role: str, model: Path) -> WorkerConfig:
    return WorkerConfig(
        role=role,
        engine=EngineConfig(model=ModelLoadConfig(path=str(model)), kv_cache_bytes=4 << 20),
        cluster_secret=SECRET,
        kv_transport="tcp",
        reap_interval_s=0.05,
        transfer_chunk_timeout_s=0.5,
    )


async def open_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession()


@pytest.fixture(scope="module")
def node(tiny_model_path: Path) -> Iterator[Node]:
    loop = asyncio.new_event_loop()
    workers = {role: Worker(worker_config(role, tiny_model_path)) for role in ROLES}
    untyped = Untyped()
    for name in ("pdserve", "asyncio", "aiohttp"):
        logging.getLogger(name).addHandler(untyped)
    for worker in workers.values():
        loop.run_until_complete(worker.start())
    node = Node(loop, workers, loop.run_until_complete(open_session()), untyped)
    for role in ROLES:
        _, text = loop.run_until_complete(call(node, role, "GET", "/health", b""))
        node.num_blocks[role] = protocol.WorkerHealth.model_validate_json(text).num_blocks
    try:
        yield node
    finally:
        loop.run_until_complete(node.session.close())
        for worker in workers.values():
            loop.run_until_complete(worker.stop())
        loop.close()
        for name in ("pdserve", "asyncio", "aiohttp"):
            logging.getLogger(name).removeHandler(untyped)


async def call(node: Node, role: str, method: str, path: str, raw: bytes) -> tuple[int, str]:
    """One signed call to the `role` worker; a stream still running after STREAM_BUDGET_S is
    abandoned (the client disconnects) and its text so far returned with status -1."""
    headers = signed_headers(method, path, raw)
    url = node.url(role) + path
    async with (
        asyncio.timeout(CALL_TIMEOUT_S),
        node.session.request(method, url, data=raw, headers=headers) as resp,
    ):
        if path not in STREAMED or resp.status != 200:
            return resp.status, await resp.text()
        lines: list[str] = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STREAM_BUDGET_S):
                async for line in resp.content:
                    lines.append(line.decode())
                return resp.status, "".join(lines)
        note("client left a running stream")
        resp.close()
        return -1, "".join(lines)


def check_answer(path: str, status: int, text: str) -> None:
    if status == -1:  # left running: whatever arrived is well formed
        for line in text.splitlines():
            protocol.TokenEvent.model_validate_json(line)
        return
    if status == 200:
        if path in STREAMED:
            events = [protocol.TokenEvent.model_validate_json(x) for x in text.splitlines()]
            assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
            note(f"{path} 200 {events[-1].finish_reason} {events[-1].error_type or ''}")
        else:
            RESPONSES[path].model_validate_json(text)
            note(f"{path} 200")
        return
    assert status in (400, 403, 404, 409, 503, 504), (path, status, text[:300])
    body = protocol.ErrorBody.model_validate_json(text)
    known = body.type == "ValidationError" or (
        isinstance(getattr(errors, body.type, None), type)
        and issubclass(getattr(errors, body.type), errors.PdserveError)
    )
    assert known, body
    note(f"{path} {status} {body.type}")


@dataclass
class Example:
    """What one example did: the request ids it used and the reservations it got back."""

    rids: set[str] = field(default_factory=lambda: set(RIDS))
    reservations: dict[str, dict[str, Any]] = field(default_factory=dict)


@st.composite
def worker_calls(
    draw: st.DrawFn, example: Example, path: str | None = None, rid: str | None = None
) -> tuple[str, bytes]:
    """One call: to `path` (or any endpoint) for `rid` (or any), a valid body with 0..3
    edits, a random JSON document or random bytes; a /prefill may carry a reservation this
    example got, its fields edited before the router's signature is put on it. Calls of a
    flow (`rid` given) are mostly valid, so that the flow gets far."""
    path = path or draw(st.sampled_from(sorted(REQUESTS)))
    kinds = ["edited"] * 6 + ["valid"] * 3 + ["document", "bytes"]
    kind = draw(st.sampled_from(kinds if rid is None else ["edited", "valid", "valid"]))
    if kind == "document":
        return path, json.dumps(draw(json_values)).encode()
    if kind == "bytes":
        return path, draw(st.binary(max_size=40))
    body = valid_body(path, rid or draw(st.sampled_from(RIDS)))
    # What is drawn must not depend on the worker's answers (hypothesis replays draws): a
    # reservation that did not come is replaced by one to nowhere, with the same fields.
    if path == "/prefill" and not draw(one_in(8)):
        source = RIDS[0] if rid is not None else draw(st.sampled_from(RIDS))
        res = dict(example.reservations.get(source, NOWHERE))
        for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
            edit(draw, res, protocol.Reservation)
        decode_url = draw(st.sampled_from([None, "http://127.0.0.1:1"]))
        try:
            body["reservation"] = signed_reservation(res, decode_url)
            note("a /prefill carries a signed reservation")
        except ValueError:  # not a Reservation any more (or not JSON): cannot be signed
            body["reservation"] = {"reservation": res, "expires_at_s": 1e12, "signature": "00"}
    for _ in range(draw(st.integers(1, 3)) if kind == "edited" else 0):
        edit(draw, body, REQUESTS[path])
    if isinstance(body.get("request_id"), str):
        example.rids.add(body["request_id"])
    return path, json.dumps(body).encode()


FLOW = ("/reserve", "/prefill", "/decode")
NOWHERE = protocol.Reservation(
    request_id="fz-nowhere",
    transfer_id="00" * 16,
    capability_token="11" * 16,
    endpoints=[protocol.KVEndpoint(transport="tcp", address="127.0.0.1:1")],
    lease_epoch=1,
    num_cached_tokens=0,
    lease_ttl_s=2.0,
).model_dump(mode="json")


async def settle(node: Node, example: Example) -> None:
    """Release every request id the example used on both workers; then nothing may be held."""
    for role, rid in itertools.product(ROLES, sorted(example.rids)):
        raw = json.dumps({"request_id": rid}).encode()
        status, text = await call(node, role, "POST", "/release", raw)
        assert status in (200, 400), text  # 400: an id JSON cannot carry back (a surrogate)
    for role, worker in node.workers.items():
        async with asyncio.timeout(SETTLE_TIMEOUT_S):
            if worker.inbox is not None:
                await worker.inbox.wait_idle()  # cancellations the lease reaper started
            while True:  # aborted requests leaving the engine, sends that are ending
                _, text = await call(node, role, "GET", "/health", b"")
                health = protocol.WorkerHealth.model_validate_json(text)
                sending = worker.outbox.num_in_flight if worker.outbox is not None else 0
                if not (health.num_running or health.num_waiting or sending):
                    break
                await asyncio.sleep(0.02)
        table = worker.leases.table
        held = {
            (b, lease.holder) for b in range(node.num_blocks[role]) if (lease := table.lease_of(b))
        }
        assert health.num_active_leases == 0 and worker.leases.num_active == 0, (role, held)
        assert health.num_pinned_blocks == 0, role
        assert health.num_free_blocks == node.num_blocks[role], role
        if worker.inbox is not None:
            assert worker.inbox.num_reserved_blocks == 0
            assert worker.inbox.receiver.num_expected == 0


# No shrinking: examples share two live workers, so a failing example can leave state behind
# that fails the shrinker's next tries for another reason; the first failure is the one to read.
@fuzz_settings(60, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(st.data())
def test_real_workers_answer_every_call_typed_and_leak_nothing(
    node: Node, data: st.DataObject
) -> None:
    example = Example()
    node.untyped.records.clear()

    async def run() -> None:
        # Half the examples follow the disaggregated flow (reserve, prefill with the
        # reservation, decode) so fuzzed calls meet live state; the rest are any calls.
        try:
            flow = data.draw(st.booleans())
            paths = FLOW if flow else [None] * data.draw(st.integers(1, 4))
            for want in paths:
                path, raw = data.draw(worker_calls(example, want, RIDS[0] if flow else None))
                # Sometimes the worker of the other role (409 WrongRole, or /release there).
                role = ROLE_OF[path]
                if data.draw(one_in(10)):
                    role = "decode" if role == "prefill" else "prefill"
                status, text = await call(node, role, "POST", path, raw)
                check_answer(path, status, text)
                if path == "/reserve" and status == 200:
                    reservation = protocol.Reservation.model_validate_json(text)
                    example.reservations[reservation.request_id] = reservation.model_dump(
                        mode="json"
                    )
        finally:
            # Also when hypothesis ends the example early (a draw past its data budget):
            # whatever it started must not be left to the next example.
            await settle(node, example)

    node.loop.run_until_complete(run())
    assert node.untyped.records == []


# ---- any bytes in any header or path (the signature's header first) -------------------------


def field_text(min_size: int, max_size: int) -> st.SearchStrategy[str]:
    """One field of the header: any characters but the separators (space, CR, LF)."""
    chars = st.characters(blacklist_characters=" \r\n", blacklist_categories=["Cc"])
    return st.text(chars, min_size=min_size, max_size=max_size)


WORKER_PATHS = [*(p.encode() for p in REQUESTS), b"/health", b"/metrics", b"/admin/faults",
                b"/debug/requests/fz-0", b"/%ff", b"/reserve\xc3\x28"]  # fmt: skip
AUTH_VALUES = st.one_of(
    header_values,
    # The scheme's shape with any fields: non-ASCII nonce or MAC, NaN or huge timestamps.
    st.tuples(
        st.sampled_from(["1e308", "nan", "inf", "-0", "1.5"]),
        st.one_of(st.just("n" * 12), field_text(8, 16)),
        st.one_of(st.just("0" * 64), field_text(1, 64)),
    ).map(lambda p: " ".join(("pdserve-v1", *p)).encode("utf-8", "surrogatepass")),
)


@fuzz_settings(60)
@given(
    method=st.sampled_from([b"GET", b"POST", b"DELETE"]),
    path=st.sampled_from(WORKER_PATHS),
    auth=AUTH_VALUES,
    others=st.lists(st.tuples(st.sampled_from([b"Content-Type", b"X-Any"]), header_values),
                    max_size=2),
    body=st.binary(max_size=64),
)  # fmt: skip
# What issue 31 found: a non-ASCII MAC raised inside compare_digest (a 500).
@example(method=b"POST", path=b"/reserve", auth="pdserve-v1 1.5 nnnnnnnnnnnn é".encode(),
         others=[], body=b"")  # fmt: skip
def test_any_header_bytes_get_a_typed_answer_never_a_500(
    node: Node, method: bytes, path: bytes, auth: bytes,
    others: list[tuple[bytes, bytes]], body: bytes,
) -> None:  # fmt: skip
    node.untyped.records.clear()
    host, port = node.url("decode").removeprefix("http://").rsplit(":", 1)
    headers = [(b"X-Pdserve-Auth", auth), *others]
    status, _ = node.loop.run_until_complete(
        raw_request(host, int(port), method, path, headers, body)
    )
    assert status < 500 or status in (503, 504), (status, path, auth)
    # aiohttp logs each request its parser refused (a 400 on a NUL in a header): not ours.
    ours = [r for r in node.untyped.records if not r.startswith("aiohttp.server: Error handling")]
    assert ours == []


# ---- what the fuzz found -----------------------------------------------------------------------

PROMPT_BODY = '"request_id": "fz-r", "prompt_token_ids": [1, 2, 3]'


@pytest.mark.parametrize(
    ("role", "path", "raw", "field"),
    [
        # A 500 (ValueError from the lease table) instead of a 400.
        ("decode", "/reserve", f'{{{PROMPT_BODY}, "sampling": {{}}, "lease_ttl_s": Infinity}}',
         "lease_ttl_s"),
        # Accepted; the engine step then failed (OverflowError) with every request in it.
        ("decode", "/generate",
         f'{{{PROMPT_BODY}, "sampling": {{"seed": 18446744073709551616}}}}', "seed"),
        # Accepted (200); the KV send then failed in the background (ValueError).
        ("prefill", "/prefill", None, "lease_epoch"),
    ],
    ids=["infinite-lease-ttl", "seed-2**64", "epoch-2**64"],
)  # fmt: skip
def test_bodies_the_fuzz_found_get_a_400_naming_the_field(
    node: Node, role: str, path: str, raw: str | None, field: str
) -> None:
    if raw is None:
        reservation = dict(NOWHERE, lease_epoch=1 << 64)
        signed = signed_reservation(dict(NOWHERE), None)
        signed["reservation"] = reservation  # the field is checked before the signature
        body = {"request_id": "fz-r", "prompt_token_ids": [1, 2, 3], "sampling": {},
                "reservation": signed}  # fmt: skip
        raw = json.dumps(body)
    status, text = node.loop.run_until_complete(call(node, role, "POST", path, raw.encode()))
    assert status == 400, text
    assert field in protocol.ErrorBody.model_validate_json(text).error


def test_dropping_a_lapsed_lease_ends_it_now() -> None:
    """Found by the worker fuzz: a reservation released after its lease's deadline but before
    the reaper's sweep kept its lease (and its blocks leased) until that sweep, so a grant in
    between left those blocks out of the next holder's lease."""
    clock = FakeClock()
    keeper = LeaseKeeper(clock=clock)
    expired: list[str] = []
    lapsed = keeper.grant([1, 2], 1.0, "reservation a", lambda: expired.append("a"))
    other = keeper.grant([3], 1.0, "reservation b", lambda: expired.append("b"))
    clock.advance(1.0)
    keeper.drop(lapsed)
    assert keeper.table.lease_of(1) is None and keeper.table.lease_of(2) is None
    assert expired == ["b"]  # the sweep ran the other due callback, not the dropped one's
    assert keeper.num_active == 0
    again = keeper.grant([1, 2], 5.0, "reservation c", lambda: None)
    assert again.lease_id == keeper.table.lease_of(1).lease_id == keeper.table.lease_of(2).lease_id
    keeper.drop(other)  # already ended: nothing happens
