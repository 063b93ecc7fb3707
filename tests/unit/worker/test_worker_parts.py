"""The worker's small parts: flags to config (bad flag: exit 2, one line), the lease keeper's
expiry callbacks on a fake clock, the error table, and the atomic ready file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pydantic
import pytest

from pdserve.child.ready_file import write_ready_file
from pdserve.clock import FakeClock
from pdserve.errors import ChecksumMismatch, NoFreeBlocks, PromptTooLong, RequestNotFound, WrongRole
from pdserve.protocol.worker_api import GenerateRequest
from pdserve.worker.config import WorkerConfig
from pdserve.worker.http.error_status import error_response
from pdserve.worker.lease_keeper import LeaseKeeper
from pdserve.worker.main import build_config, build_parser, main


def test_flags_build_one_typed_config(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            *("--role", "decode", "--block-size", "32", "--kv-cache-bytes", "1048576"),
            *("--quantization", "int8", "--ready-file", str(tmp_path / "r.json")),
        ]
    )
    config = build_config(args)
    assert (config.role, config.serves_decode, config.serves_prefill) == ("decode", True, False)
    assert (config.engine.block_size, config.engine.kv_cache_bytes) == (32, 1 << 20)
    assert config.engine.model.quantization == "int8"
    assert config.worker_id == f"decode-{os.getpid()}"
    assert config.ready_file == tmp_path / "r.json"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--role", "router"], "--role"),
        (["--port", "http"], "--port"),
        (["--bogus"], "--bogus"),
        (["--block-size", "0"], "--block-size"),
        (["--port", "70000"], "port"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        code = main(argv)
        raise SystemExit(code)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and err.startswith("pdserve worker: error:")


def test_bad_config_values_name_the_field() -> None:
    with pytest.raises(ValueError, match="role"):
        WorkerConfig(role="router")
    with pytest.raises(ValueError, match="reap_interval_s"):
        WorkerConfig(reap_interval_s=0)


def test_reaper_runs_expiry_callbacks_once_and_not_for_dropped_leases() -> None:
    clock = FakeClock()
    keeper = LeaseKeeper(clock=clock)
    expired: list[str] = []
    a = keeper.grant([1, 2], 1.0, "a", lambda: expired.append("a"))
    b = keeper.grant([3], 1.0, "b", lambda: expired.append("b"))
    # A block already under a lease (a shared prefix block) is left out, not refused.
    c = keeper.grant([2, 4], 5.0, "c", lambda: expired.append("c"))
    shared = keeper.table.lease_of(2)
    assert shared is not None and shared.holder == "a"
    keeper.drop(b)
    keeper.drop(b)  # idempotent
    clock.advance(1.0)
    assert keeper.reap() == 1
    assert expired == ["a"]
    with pytest.raises(Exception, match="expired"):
        keeper.check(a)
    keeper.check(c)
    clock.advance(4.0)
    keeper.reap()
    assert expired == ["a", "c"]
    assert keeper.num_active == 0 and keeper.num_expired_total == 2


def _status(exc: BaseException) -> tuple[int, dict[str, object]]:
    response = error_response(exc, "w1")
    assert response.text is not None
    return response.status, json.loads(response.text)


def test_errors_map_to_status_and_error_body() -> None:
    assert _status(PromptTooLong("too long"))[0] == 400
    assert _status(RequestNotFound("r"))[0] == 404
    assert _status(WrongRole("no"))[0] == 409
    status, body = _status(NoFreeBlocks("full"))
    assert (status, body["type"], body["retryable"], body["worker_id"]) == (
        503,
        "NoFreeBlocks",
        True,
        "w1",
    )
    assert error_response(NoFreeBlocks("full"), "w1").headers["Retry-After"] == "1"
    assert _status(ChecksumMismatch("x"))[1]["retryable"] is True
    assert _status(RuntimeError("boom"))[:1] == (500,)
    try:
        GenerateRequest.model_validate({"request_id": "r", "sampling": {"top_k": "x"}})
    except pydantic.ValidationError as exc:
        status, body = _status(exc)
    assert status == 400
    assert "prompt_token_ids" in str(body["error"]) and "sampling.top_k" in str(body["error"])


def test_ready_file_is_written_whole(tmp_path: Path) -> None:
    path = tmp_path / "ready.json"
    write_ready_file(path, "http://127.0.0.1:1234")
    assert json.loads(path.read_text()) == {"url": "http://127.0.0.1:1234", "pid": os.getpid()}
    assert [p.name for p in tmp_path.iterdir()] == ["ready.json"]


class _Closing:
    """A streamed response whose reader is gone (or whose write fails otherwise)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def write_eof(self) -> None:
        raise self.exc


def test_a_stream_whose_reader_left_ends_quietly_and_other_faults_still_raise() -> None:
    import asyncio

    import aiohttp

    from pdserve.worker.http.token_stream import end_stream

    gone = _Closing(aiohttp.ClientConnectionResetError("Cannot write to closing transport"))
    asyncio.run(end_stream(gone))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        asyncio.run(end_stream(_Closing(RuntimeError("bug"))))  # type: ignore[arg-type]
