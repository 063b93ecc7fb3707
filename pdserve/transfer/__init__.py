"""The KV data plane: wire codec, transfer sessions and leases (pure code), plus transports.

Pure parts, none of which touches a socket, asyncio, torch or the scheduler:
- `messages` / `wire`: the typed messages and their bounded body encodings;
- `codec`: the frame layout, `encode`, `decode_header`, `decode_body`;
- `sender_session` / `receiver_session`: the protocol as transition tables;
- `lease`: fenced, expiring holds on KV blocks.
Transports (TCP, shared memory, NIXL, fault-injecting) live in their own modules, behind
one `ByteStream` (`stream`). Import from the modules themselves: this package re-exports
nothing.
"""
