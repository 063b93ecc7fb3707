"""The KV data plane: wire codec, transfer sessions and leases (pure code), plus transports.

Pure parts, none of which touches a socket, asyncio, torch or the scheduler:
- `messages` / `wire`: the typed messages and their bounded body encodings;
- `codec`: the frame layout, `encode`, `decode_header`, `decode_body`;
- `sender_session` / `receiver_session`: the protocol as transition tables;
- `lease`: fenced, expiring holds on KV blocks.
Transports (TCP, shared memory, in-memory, fault-injecting) live in their own modules.
"""

from pdserve.transfer.codec import (
    HEADER_BYTES,
    MAX_BODY_BYTES,
    MAX_DATA_BYTES,
    Envelope,
    Frame,
    FrameHeader,
    data_checksum,
    decode_body,
    decode_header,
    encode,
    verify_data,
)
from pdserve.transfer.lease import Lease, LeaseTable
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
    MsgType,
    Nack,
    NackCode,
    Renew,
    Role,
    commit_digest,
    token_digest,
)
from pdserve.transfer.receiver_session import ReceivePlan, ReceiverSession, ReceiverState
from pdserve.transfer.sender_session import SenderAction, SenderSession, SenderState
from pdserve.transfer.session import Outbound, fingerprint_diff
from pdserve.transfer.wire import encode_fingerprint

__all__ = [
    "HEADER_BYTES",
    "MAX_BODY_BYTES",
    "MAX_DATA_BYTES",
    "PROTOCOL_VERSION",
    "Abort",
    "Ack",
    "AckOf",
    "Begin",
    "Chunk",
    "Commit",
    "Envelope",
    "Frame",
    "FrameHeader",
    "Hello",
    "KVLayout",
    "Lease",
    "LeaseTable",
    "Message",
    "MsgType",
    "Nack",
    "NackCode",
    "Outbound",
    "ReceivePlan",
    "ReceiverSession",
    "ReceiverState",
    "Renew",
    "Role",
    "SenderAction",
    "SenderSession",
    "SenderState",
    "commit_digest",
    "data_checksum",
    "decode_body",
    "decode_header",
    "encode",
    "encode_fingerprint",
    "fingerprint_diff",
    "token_digest",
    "verify_data",
]
