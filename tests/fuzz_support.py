"""What the fuzz tests share: their fixed budget, and random JSON.

Budget: hypothesis settings that make CI time bounded and runs reproducible.
In CI (the default) each fuzz test runs exactly `max_examples` examples drawn from a fixed
seed (`derandomize`), with no example database, so two runs try the same inputs and a failure
reproduces by rerunning the test. For a longer exploratory run outside CI, set
`PDSERVE_FUZZ_SCALE=N`: budgets grow N times and the seed is random (a failure prints the
`@reproduce_failure` blob to paste back). Per-example deadlines are off (a shared 2-core
machine makes them flaky); hangs are bounded by the tests' own timeouts instead.

Random JSON (`json_values`): any document, with the values that break parsers and what is
behind them: huge and negative integers, NaN and infinities (json.dumps writes them as NaN and
Infinity), denormals, lone surrogates (written as "\\udXXX" escapes), long strings, nesting.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

SCALE = int(os.environ.get("PDSERVE_FUZZ_SCALE", "1"))


def fuzz_settings(max_examples: int, **overrides: Any) -> settings:
    """Settings for a fuzz test of `max_examples` examples (times PDSERVE_FUZZ_SCALE)."""
    return settings(
        max_examples=max_examples * SCALE,
        deadline=None,
        derandomize=SCALE == 1,
        database=None,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.large_base_example,
        ],
        **overrides,
    )


def note(text: str) -> None:
    """Count an outcome in hypothesis' statistics (`pytest --hypothesis-show-statistics`);
    a no-op outside a hypothesis test, so fuzz harnesses also run in plain tests."""
    if currently_in_test_context():
        event(text)


def one_in(n: int) -> st.SearchStrategy[bool]:
    """True about once in `n` draws (an integer draw compared with 0 comes up more often)."""
    return st.sampled_from([False] * (n - 1) + [True])


# ---- random JSON -------------------------------------------------------------------------------

lone_surrogates = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)
long_strings = st.builds(
    lambda piece, n: piece * n,
    st.sampled_from(["x", "é", "🙂", "\0", " the"]),
    st.integers(1000, 40_000),
)
numbers = st.one_of(
    st.integers(),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), 10**30]),
    st.floats(),
    st.sampled_from([5e-324, 1e-300, 1e308, -0.0, 0.5, 1.5]),
)
leaves = st.one_of(
    st.none(), st.booleans(), numbers, st.text(max_size=12), lone_surrogates, long_strings
)
json_values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


# ---- raw HTTP ----------------------------------------------------------------------------------

# Header values with no CR or LF (they would end the header), anything else: NUL, high bytes.
header_values = st.binary(max_size=64).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


async def raw_request(
    host: str,
    port: int,
    method: bytes,
    path: bytes,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
) -> tuple[int, bytes]:
    """One HTTP/1.1 request written byte for byte (no client library cleans it); the status
    and the body of the answer."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = [
            method + b" " + path + b" HTTP/1.1",
            b"Host: " + host.encode(),
            b"Connection: close",
        ]
        head += [b"Content-Length: %d" % len(body)]
        head += [name + b": " + value for name, value in headers]
        writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]
