"""The router process against real worker processes (one prefill, one `both`) on loopback.

One cluster per module: the workers start in parallel, the router is
`python -m pdserve.router.main` with a ready file, and every process is stopped by PID at the
end (the router by SIGTERM, which must exit 0). Greedy decoding makes the disaggregated text
comparable token for token with the colocated text.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from worker_proc import launch_worker, router_process, wait_ready, worker_processes

from pdserve.router.api import sse

MODEL = "tiny-v2"


def post(url: str, body: object) -> tuple[int, bytes]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def router_url(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("router-cluster")
    with worker_processes() as handles:
        for role in ("prefill", "both"):
            handles.append(launch_worker(role, workdir, model=tiny_model_path))
        for handle in handles:
            wait_ready(handle)
        with router_process(workdir, tiny_model_path, [h.url for h in handles]) as url:
            yield url


def set_mode(url: str, mode: str) -> None:
    status, body = post(f"{url}/admin/mode", {"mode": mode})
    assert status == 200, body


def complete(url: str, **kw: object) -> dict[str, object]:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    status, raw = post(f"{url}/v1/completions", {**body, **kw})
    assert status == 200, raw
    data: dict[str, object] = json.loads(raw)
    return data


def stream_text(url: str, path: str, body: dict[str, object]) -> tuple[str, list[dict]]:  # type: ignore[type-arg]
    status, raw = post(f"{url}{path}", {**body, "stream": True,
                                        "stream_options": {"include_usage": True}})  # fmt: skip
    assert status == 200, raw
    events = sse.parse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    key = "text" if path == "/v1/completions" else "delta"
    parts = [
        c["choices"][0][key] if key == "text" else c["choices"][0]["delta"].get("content") or ""
        for c in chunks
        if c["choices"]
    ]
    return "".join(parts), chunks


def test_disagg_text_equals_colocated_text(router_url: str) -> None:
    disagg = complete(router_url)
    set_mode(router_url, "colocated")
    try:
        colocated = complete(router_url)
    finally:
        set_mode(router_url, "disagg")
    choice = disagg["choices"][0]  # type: ignore[index]
    assert choice["text"] and choice["finish_reason"] == "length"
    assert choice == colocated["choices"][0]  # type: ignore[index]
    assert disagg["usage"] == colocated["usage"]
    assert disagg["usage"]["completion_tokens"] == 12  # type: ignore[index]


def test_streamed_completion_matches_whole_and_ends_with_usage(router_url: str) -> None:
    whole = complete(router_url)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    text, chunks = stream_text(router_url, "/v1/completions", body)
    assert text == whole["choices"][0]["text"]  # type: ignore[index]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == whole["usage"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_and_whole(router_url: str) -> None:
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a story."}]}  # fmt: skip
    status, raw = post(f"{router_url}/v1/chat/completions", body)
    assert status == 200, raw
    whole = json.loads(raw)
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]
    text, chunks = stream_text(router_url, "/v1/chat/completions", body)
    assert text == message["content"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage = chunks[-1]["usage"]
    # The second run of the same prompt finds its full blocks in a prefix cache.
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]
    assert whole["usage"].pop("prompt_tokens_details") == {"cached_tokens": 0}
    assert usage == whole["usage"] and 0 < cached < usage["prompt_tokens"]


def test_stop_string_with_real_tokens(router_url: str) -> None:
    text = complete(router_url)["choices"][0]["text"]  # type: ignore[index]
    stop = text[3:6]
    stopped = complete(router_url, stop=stop)["choices"][0]  # type: ignore[index]
    assert stopped["text"] == text[: text.index(stop)]
    assert stopped["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"prompt": "word " * 4000}, "prompt"),
        ({"model": "nope"}, "model"),
        ({"n": 0}, "n"),
        ({"temperature": -0.5}, "temperature"),
    ],
)
def test_errors_are_400_with_param(router_url: str, patch: dict[str, object], param: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **patch}
    status, raw = post(f"{router_url}/v1/completions", body)
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert complete(router_url, max_tokens=2)["choices"]  # still serving


def test_trace_prints_the_waterfall_of_a_finished_request(
    router_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdserve.cli import main

    set_mode(router_url, "disagg")
    rid = str(complete(router_url, max_tokens=4)["id"])
    assert main(["trace", rid, "--url", router_url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"request {rid}  mode disagg  state FINISHED")
    states = [line.split()[0] for line in out[2:-1]]
    assert states[:3] == ["RECEIVED", "ROUTED", "RESERVED"] and states[-1] == "FINISHED"
    assert out[-1].startswith("phases: reserve ") and " transfer " in out[-1]
    assert main(["trace", "cmpl-unknown", "--url", router_url]) == 2
    assert "unknown or evicted request cmpl-unknown" in capsys.readouterr().err
