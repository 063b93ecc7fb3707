"""Coverage-guided fuzzing of the KV frame decoder with atheris (libFuzzer), outside CI.

The CI fuzz tests (`tests/unit/transfer/test_fuzz_*.py`) run a fixed hypothesis budget; this
harness runs for as long as you let it, guided by the coverage of `pdserve.transfer`'s codec.
A byte mutator alone never gets past the header and body checksums (xxh3), so an input is
read as instructions: either raw bytes fed as they are, or frames whose header fields, body and
data come from the input and whose checksums the harness seals (mostly), so the mutations reach
the message and field decoders. The property is the CI one: `FrameDecoder` returns frames or
raises a `ProtocolError`, and every frame it returns re-encodes to exactly the bytes it took.

Run (atheris is the `fuzz` extra: `pip install -e '.[fuzz]'`), from the repository root:

    PYTHONPATH=. python tests/fuzz/frame_decoder_atheris.py -max_total_time=300 CORPUS_DIR

CORPUS_DIR is created and seeded with one valid frame of every message type when empty;
libFuzzer keeps the inputs that found new coverage there, and writes a crashing input to
./crash-* (rerun the harness with that file as its only argument to reproduce it).
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import atheris
import xxhash

with atheris.instrument_imports(include=["pdserve.transfer"]):
    from frame_decoder import FrameDecoder

    from pdserve.errors import ProtocolError
    from pdserve.transfer.codec import HEADER, MAGIC, Envelope, encode
    from pdserve.transfer.messages import (
        PROTOCOL_VERSION,
        Abort,
        Ack,
        AckOf,
        Begin,
        Chunk,
        Commit,
        Hello,
        KVLayout,
        Message,
        Nack,
        NackCode,
        Renew,
        Role,
    )

_RAW, _SEALED = 0, 1


def _frame(message: Message, data: bytes = b"") -> bytes:
    return b"".join(bytes(p) for p in encode(message, data or None, envelope=Envelope()))


def _seeds() -> list[bytes]:
    """One valid frame of every message type, prefixed as a raw-mode input."""
    fp = {"model": "tiny", "layers": 2}
    data = bytes(range(64))
    layout = KVLayout(2, 1, 64, "float32", 16)
    messages: list[tuple[Message, bytes]] = [
        (Hello(PROTOCOL_VERSION, Role.PREFILL, fp), b""),
        (Hello(PROTOCOL_VERSION, Role.DECODE, fp, b"m" * 32), b""),
        (Begin(b"t" * 16, "req", 1, layout, 40, b"d" * 16, b"c" * 16, 7), b""),
        (Chunk(0, 64, xxhash.xxh3_64_intdigest(data)), data),
        (Commit(1, 1, 64, b"canary"), b""),
        (Ack(AckOf.COMMIT), b""),
        (Nack(NackCode.LEASE, "lease expired", False), b""),
        (Renew(1, 7, 2.5), b""),
        (Abort("deadline"), b""),
    ]
    return [bytes([_RAW]) + _frame(m, d) for m, d in messages]


def _sealed_frames(fdp: atheris.FuzzedDataProvider) -> bytes:
    """Frames built from the input: header fields, body and data taken from it, checksums
    sealed (unless the input says otherwise)."""
    out = bytearray()
    for _ in range(fdp.ConsumeIntInRange(1, 4)):
        msg_type = fdp.ConsumeIntInRange(0, 10)
        body = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 300))
        data = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 200)) if msg_type == 3 else b""
        body_sum = xxhash.xxh3_64_intdigest(body)
        data_sum = xxhash.xxh3_64_intdigest(data)
        if fdp.ConsumeIntInRange(0, 15) == 0:  # now and then a stale checksum
            body_sum ^= fdp.ConsumeInt(8) & 0xFFFF_FFFF_FFFF_FFFF
        fields = (
            MAGIC, PROTOCOL_VERSION, msg_type, 0, fdp.ConsumeBytes(16).ljust(16, b"\0"),
            fdp.ConsumeIntInRange(0, 3), fdp.ConsumeIntInRange(0, 3), len(body), len(data),
            body_sum, data_sum,
        )  # fmt: skip
        checked = HEADER.pack(*fields, 0)[:-8]
        out += checked + struct.pack("<Q", xxhash.xxh3_64_intdigest(checked)) + body + data
    return bytes(out)


def test_one_input(raw: bytes) -> None:
    """libFuzzer's entry point: one input, the decoder's property checked."""
    fdp = atheris.FuzzedDataProvider(raw)
    mode = fdp.ConsumeIntInRange(_RAW, _SEALED)
    cut = fdp.ConsumeIntInRange(0, 256)
    stream = fdp.ConsumeBytes(fdp.remaining_bytes()) if mode == _RAW else _sealed_frames(fdp)
    decoder = FrameDecoder()
    taken = b""
    try:
        for piece in (stream[:cut], stream[cut:]):
            for frame in decoder.feed(piece):
                parts = encode(frame.message, frame.data or None, envelope=frame.header.envelope)
                taken += b"".join(bytes(p) for p in parts)
        decoder.feed_eof()
    except ProtocolError:
        return
    if taken != stream:
        raise AssertionError(f"decoded frames re-encode to other bytes: {stream.hex()}")


def main() -> None:
    args = sys.argv[1:]
    corpus = next((Path(a) for a in args if not a.startswith("-")), None)
    if corpus is not None and (not corpus.exists() or corpus.is_dir()):
        corpus.mkdir(parents=True, exist_ok=True)
        if not any(corpus.iterdir()):
            for i, seed in enumerate(_seeds()):
                (corpus / f"seed-{i}").write_bytes(seed)
    atheris.Setup([sys.argv[0], *args], test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
