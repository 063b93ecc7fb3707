"""Who may use which plane of the router (`router/access.py`): the table, pure; then through a
real router app: the admin key apart from the API key, admin over loopback only when it has
no key, /metrics behind its own key, and any bytes in any header or path never a 500."""

from __future__ import annotations

import socket
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from cluster_auth import SECRET
from fake_worker import FakeWorker
from fuzz_support import fuzz_settings, header_values, raw_request
from hypothesis import given
from hypothesis import strategies as st
from router_harness import completion, router, run

from pdserve.auth.keys import BearerKey, KeyKind
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.access import (
    AccessKeys,
    Plane,
    check_access,
    exposed_warnings,
    is_loopback,
    plane_of,
)
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.workers.model_check import router_model_fields

API = BearerKey("api-key-123", KeyKind.API, "test")
ADMIN = BearerKey("admin-key-456", KeyKind.ADMIN, "test")
METRICS = BearerKey("metrics-key-789", KeyKind.METRICS, "test")
ALL = AccessKeys(API, ADMIN, METRICS)


@pytest.fixture(scope="module")
def tokens(tiny_model_path: Path) -> list[int]:
    return Tokenizer(tiny_model_path).encode(" the cat sat on the mat", add_special_tokens=False)


@pytest.fixture(scope="module")
def model(tiny_model_path: Path) -> Path:
    return tiny_model_path


def bearer(key: BearerKey) -> str:
    return f"Bearer {key.text}"


@pytest.mark.parametrize(
    ("path", "plane"),
    [
        ("/v1/completions", Plane.INFERENCE),
        ("/v1/models", Plane.INFERENCE),
        ("/admin/mode", Plane.ADMIN),
        ("/debug/requests/r1", Plane.ADMIN),
        ("/metrics", Plane.METRICS),
        ("/health", Plane.OPEN),
        ("/tokenize", Plane.OPEN),
        ("/v1", Plane.OPEN),
    ],
)
def test_each_path_belongs_to_one_plane(path: str, plane: Plane) -> None:
    assert plane_of(path) is plane


def test_each_key_opens_its_own_plane_only() -> None:
    for plane, right in ((Plane.INFERENCE, API), (Plane.ADMIN, ADMIN), (Plane.METRICS, METRICS)):
        for key in (API, ADMIN, METRICS):
            refused = check_access(plane, ALL, bearer(key), on_loopback=True)
            if key is right:
                assert refused is None
            else:
                # Loopback does not stand in for a configured key.
                assert refused is not None and refused.status == 401
                assert plane.value in refused.message


def test_without_keys_everything_is_open_but_admin_away_from_loopback() -> None:
    none = AccessKeys()
    for plane in Plane:
        assert check_access(plane, none, None, on_loopback=True) is None
        refused = check_access(plane, none, None, on_loopback=False)
        if plane is Plane.ADMIN:
            assert refused is not None and refused.status == 403
            assert "--admin-key-file" in refused.message
        else:
            assert refused is None


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.9.9.9", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("192.0.2.2", False),
        ("0.0.0.0", False),
        ("fe80::1%eth0", False),
        ("not an address", False),
        (None, False),
        (("127.0.0.1", 80), False),
    ],
)
def test_loopback_is_judged_by_address(address: object, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_an_exposed_router_without_keys_is_warned_about() -> None:
    assert exposed_warnings("127.0.0.1", AccessKeys()) == []
    assert exposed_warnings("localhost", AccessKeys()) == []
    warnings = exposed_warnings("0.0.0.0", AccessKeys())
    assert len(warnings) == 2 and "no API key" in warnings[0] and "loopback" in warnings[1]
    assert exposed_warnings("0.0.0.0", AccessKeys(API, ADMIN)) == []


# ---- through a real router app ---------------------------------------------------------------


def test_the_api_key_cannot_administer_and_the_admin_key_cannot_infer(
    model: Path, tokens: list[int]
) -> None:
    both = FakeWorker("both", tokens)

    async def body() -> None:
        keys = {"admin_key": ADMIN, "metrics_key": METRICS}
        async with router(model, [both], mode="colocated", api_key=API.text, **keys) as client:
            api = {"Authorization": bearer(API)}
            admin = {"Authorization": bearer(ADMIN)}
            assert (
                await client.post("/v1/completions", json=completion(), headers=api)
            ).status == 200
            resp = await client.post("/v1/completions", json=completion(), headers=admin)
            assert resp.status == 401
            assert (await resp.json())["error"]["type"] == "authentication_error"
            assert (await client.get("/admin/auto", headers=api)).status == 401
            assert (await client.get("/admin/auto", headers=admin)).status == 200
            assert (await client.get("/debug/kv_index", headers=api)).status == 401
            assert (await client.get("/debug/kv_index", headers=admin)).status == 200
            assert (await client.get("/metrics")).status == 401
            metrics = {"Authorization": bearer(METRICS)}
            assert (await client.get("/metrics", headers=metrics)).status == 200
            assert (await client.get("/health")).status == 200

    run(body)


def _local_non_loopback_ipv4() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.123", 9))  # no packet is sent: this only picks a route
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if is_loopback(address) or address == "0.0.0.0" else address


def test_without_an_admin_key_admin_answers_loopback_only(model: Path, tokens: list[int]) -> None:
    public = _local_non_loopback_ipv4()
    if public is None:
        pytest.skip("this machine has no non-loopback IPv4 address to call the router at")
    both = FakeWorker("both", tokens)

    async def body() -> None:
        both.fingerprint = dict(router_model_fields(model))
        await both.start()
        config = RouterConfig(
            workers=(both.url,),
            model=model,
            mode="colocated",
            host="0.0.0.0",
            cluster_secret=SECRET,
            health_poll_interval_s=60.0,
        )
        server = TestServer(await create_app(config), host="0.0.0.0")
        client = TestClient(server)
        await client.start_server()
        try:
            async with aiohttp.ClientSession() as session:
                for host, status in (("127.0.0.1", 200), (public, 403)):
                    url = f"http://{host}:{server.port}"
                    async with session.get(f"{url}/admin/auto") as resp:
                        assert resp.status == status, host
                        if status == 403:
                            error = (await resp.json())["error"]
                            assert error["type"] == "permission_error"
                            assert "--admin-key-file" in error["message"]
                    async with session.get(f"{url}/health") as resp:
                        assert resp.status == 200
        finally:
            await client.close()
            await both.close()

    run(body)


# ---- any bytes in any header, path or body: never a 500 --------------------------------------

HEADER_NAMES = [
    b"Authorization",
    b"X-Pdserve-Auth",
    b"Content-Type",
    b"X-Request-Id",
    b"Accept",
    b"Cookie",
    b"User-Agent",
    b"X-Anything",
]
PATHS = [
    *(b"/v1/completions", b"/v1/chat/completions", b"/v1/models", b"/admin/mode"),
    *(b"/debug/requests/r", b"/metrics", b"/health", b"/tokenize", b"/%ff%fe", b"/v1/\xc3\x28"),
]


@fuzz_settings(80)
@given(
    method=st.sampled_from([b"GET", b"POST"]),
    path=st.sampled_from(PATHS),
    headers=st.lists(st.tuples(st.sampled_from(HEADER_NAMES), header_values), max_size=4),
    body=st.one_of(
        st.just(b'{"model": "tiny-v2", "prompt": "hi", "max_tokens": 2}'), st.binary(max_size=128)
    ),
)
def test_any_header_bytes_get_a_typed_answer_never_a_500(
    model: Path, tokens: list[int], method: bytes, path: bytes,
    headers: list[tuple[bytes, bytes]], body: bytes,
) -> None:  # fmt: skip
    both = FakeWorker("both", tokens)

    async def run_one() -> None:
        async with router(model, [both], mode="colocated", api_key=API.text) as client:
            status, _ = await raw_request(
                "127.0.0.1", client.port or 0, method, path, headers, body
            )
            assert status < 500 or status in (503, 504), (status, path, headers)

    run(run_one)


def test_a_body_over_the_limit_is_a_413_named_as_such(model: Path, tokens: list[int]) -> None:
    both = FakeWorker("both", tokens)

    async def body() -> None:
        async with router(model, [both], mode="colocated", max_model_len=64) as client:
            # The limit is 4 MiB + 64 bytes a position: 5 MiB is over it for 64 positions.
            prompt = "x" * (5 << 20)
            resp = await client.post("/v1/completions", json=completion(prompt=prompt))
            assert resp.status == 413
            error = (await resp.json())["error"]
            assert error["type"] == "invalid_request_error"
            assert "Maximum request body size" in error["message"]

    run(body)
