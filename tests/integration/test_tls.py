"""Mutual TLS between every cluster process, with real processes on loopback: a router and a
prefill and a decode worker given one cluster CA serve a disaggregated request end to end
(its KV over TLS on TCP), while a client holding no certificate, or one from another CA, is
refused by the router's API, a worker's HTTP and the KV port alike, and plain HTTP to a TLS
port gets nothing. Bad TLS flags are refused at start, naming the flag."""

from __future__ import annotations

import json
import socket
import ssl
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
