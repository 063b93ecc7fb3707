"""The cluster credential: one shared secret that every worker control call and every KV
connection must prove knowledge of (DESIGN.md invariant 10: only the cluster talks to workers).

- `secret.py`: where the secret comes from (a file, an environment variable) and how
  `pdserve up` makes one per cluster.
- `signing.py`: HMAC signatures of HTTP control calls, with a timestamp window and a nonce
  cache so a captured call cannot be replayed; signatures of reservations, so a prefill worker
  sends KV only to a decode endpoint the router vouched for. Pure.
"""
