"""Mutual TLS between every cluster process, with real processes on loopback: a router and a
prefill and a decode worker given one cluster CA serve a disaggregated request end to end
(its KV over TLS on TCP), while a client holding no certificate, or one from another CA, is
refused by the router's API, a worker's HTTP and the KV port alike, and plain HTTP to a TLS
port gets nothing. Bad TLS flags are refused at start, naming the flag."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from worker_proc import launch_worker, router_process, wait_ready, worker_processes

from pdlab.tls_certs import CertSet, make_cert_set
from pdserve.auth.tls import TLSConfig, client_context
from pdserve.errors import ConfigError
from pdserve.observability.exposition import parse


def context_of(certs: CertSet | None, trust: CertSet) -> ssl.SSLContext:
    """A client context trusting `trust`'s CA and presenting `certs` (None: no certificate)."""
    if certs is not None:
        context = client_context(TLSConfig(certs.cert, certs.key, trust.ca))
        assert context is not None
        return context
    context = ssl.create_default_context(cafile=str(trust.ca))
    context.check_hostname = False
    return context


def get(url: str, context: ssl.SSLContext | None) -> bytes:
    with urllib.request.urlopen(url, timeout=10, context=context) as resp:
        return resp.read()  # type: ignore[no-any-return]


def refused(url: str, context: ssl.SSLContext | None) -> bool:
    """True when the request gets no HTTP answer at all (the TLS handshake or the connection
    failed), which is what a client outside the cluster must see."""
    try:
        get(url, context)
    except (urllib.error.URLError, ssl.SSLError, ConnectionError, OSError) as exc:
        return not isinstance(exc, urllib.error.HTTPError)
    return False


def kv_handshake_refused(address: str, context: ssl.SSLContext) -> bool:
    """True when the KV port drops a TLS connection made with `context` (TLS 1.3 reports a
    refused client certificate on the first read, as an alert or as the end of the stream);
    a member's connection stays open, waiting for its first frame, until the read times out."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        try:
            with context.wrap_socket(raw, server_hostname=host) as tls:
                tls.settimeout(2)
                return tls.recv(1) == b""
        except (ssl.SSLError, ConnectionError):
            return True
        except TimeoutError:
            return False


def test_bad_tls_flags_are_refused_naming_the_flag(tmp_path: Path) -> None:
    certs = make_cert_set(tmp_path, "pd")
    with pytest.raises(ConfigError, match="tls-cert, tls-key: give both"):
        TLSConfig(cert=certs.cert)
    with pytest.raises(ConfigError, match="tls-ca: needs"):
        TLSConfig(ca=certs.ca)
    with pytest.raises(ConfigError, match=r"tls-key: .* is not a readable file"):
        TLSConfig(cert=certs.cert, key=tmp_path / "missing.key")
    other = make_cert_set(tmp_path / "other", "other")
    with pytest.raises(ConfigError, match="do not load as a certificate and its key"):
        client_context(TLSConfig(cert=certs.cert, key=other.key))


def test_a_cluster_under_mutual_tls_serves_and_refuses_outsiders(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    cluster = make_cert_set(tmp_path / "cluster", "pd")
    outsider = make_cert_set(tmp_path / "outsider", "evil")
    member = context_of(cluster, cluster)
    tls = cluster.flags()
    with worker_processes() as handles:
        handles.append(launch_worker("prefill", tmp_path, model=tiny_model_path, extra_args=tls))
        handles.append(launch_worker("decode", tmp_path, model=tiny_model_path, extra_args=tls))
        for h in handles:
            wait_ready(h, context=member)
        prefill, decode = handles
        assert prefill.url.startswith("https://") and decode.url.startswith("https://")
        with router_process(
            tmp_path, tiny_model_path, [h.url for h in handles], extra_args=tls
        ) as router:
            assert router.startswith("https://")
            body = {"model": "tiny-v2", "prompt": "Once upon a time", "max_tokens": 8,
                    "temperature": 0}  # fmt: skip
            req = urllib.request.Request(
                f"{router}/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60, context=member) as resp:
                answer = json.loads(resp.read())
            assert answer["choices"][0]["text"]
            # The KV went prefill -> decode over TLS on TCP (the only KV path under TLS).
            samples = parse(get(f"{decode.url}/metrics", member).decode())
            received = {
                dict(s.labels)["transport"]: s.value
                for s in samples
                if s.name == "pdserve_worker_kv_transport_bytes_total"
                and dict(s.labels)["direction"] == "received"
            }
            assert set(received) == {"tcp"} and received["tcp"] > 0, received

            # Outsiders: no certificate, another CA's certificate, plain HTTP.
            for url in (router, prefill.url, decode.url):
                assert refused(f"{url}/health", context_of(None, cluster)), url
                assert refused(f"{url}/health", context_of(outsider, cluster)), url
                plain = url.replace("https://", "http://")
                assert refused(f"{plain}/health", None), plain
            kv_address = str(decode.health["transfer_address"])
            assert kv_handshake_refused(kv_address, context_of(outsider, cluster))
            assert kv_handshake_refused(kv_address, context_of(None, cluster))
            assert not kv_handshake_refused(kv_address, member)

            # The operator commands dial with the cluster's files (`--tls-*`, or those a
            # `pdserve up` recorded); without any, they fail naming the router, no traceback.
            env = {**os.environ, "PDSERVE_CACHE": str(tmp_path / "no-up")}
            status = pdserve(env, "status", "--url", router, "--json", *tls)
            assert status.returncode == 0, status.stderr
            rows = json.loads(status.stdout)["workers"]
            assert [r["up"] for r in rows] == [True, True], rows
            trace = pdserve(env, "trace", answer["id"], "--url", router, "--json", *tls)
            assert trace.returncode == 0 and json.loads(trace.stdout)["history"], trace.stderr
            bare = pdserve(env, "status", "--url", router)
            assert bare.returncode == 2 and "did not answer /health" in bare.stderr, bare
            assert "Traceback" not in bare.stderr
            # `pdserve up` records its files; the commands find them without flags.
            up_state = tmp_path / "up"
            up_state.mkdir()
            files = {"cert": str(cluster.cert), "key": str(cluster.key), "ca": str(cluster.ca)}
            (up_state / "up.json").write_text(json.dumps({"router_url": router, "tls": files}))
            found = pdserve({**env, "PDSERVE_CACHE": str(up_state)}, "status", "--json")
            assert found.returncode == 0, found.stderr
            drain = pdserve(env, "drain", decode.url, "--wait", "--timeout-s", "30", *tls)
            assert drain.returncode == 0 and "drained and exited" in drain.stdout, drain
            assert decode.proc.wait(10) == 0


def pdserve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """One `pdserve` command in its own process, as an operator runs it."""
    argv = [sys.executable, "-m", "pdserve", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
