"""`Fingerprint`: everything that must match for two engines' KV caches to be interchangeable.

KV computed by one engine is only valid in another if both would have computed the same numbers
into the same layout: same architecture and shapes, same weights (digest), same tokenizer (the
same text must give the same ids), same RoPE, same dtype and quantization, same block size and
KV layout version. The transfer handshake compares fingerprints field by field and refuses a
mismatch naming every differing field; the router never pairs such workers.

`digest` is xxh3-128 over a canonical JSON of all fields (sorted keys, no whitespace), so it is
stable across processes, Python versions and machines. `to_dict`/`from_dict` are the wire form;
`from_dict` rejects unknown, missing or mistyped fields, and a `digest` that does not match.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

import xxhash

from pdserve.errors import ConfigError, FingerprintMismatch
from pdserve.model.config import ModelConfig
from pdserve.model.kv_layout import KV_LAYOUT_VERSION

# JSON types accepted for each field annotation (a float field may arrive as an integer).
_WIRE_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,)}


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """The build identity of one engine's KV cache."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    weights_digest: str
    tokenizer_digest: str
    rope_type: str
    rope_theta: float
    # Canonical sorted JSON of the scaling parameters, or "none".
    rope_scaling: str
    dtype: str
    # "none" or "int8" (a string, so the wire form has no nulls).
    quantization: str
    kv_block_size: int
    kv_layout_version: int = KV_LAYOUT_VERSION
    # "cpu" or "cuda": the same weights compute different bits on each (other kernels, other
    # reduction orders), so KV never crosses device kinds. Left out of the wire form and the
    # digest when "cpu", the only kind older builds ran, so their fingerprints still match.
    device: str = "cpu"

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        weights_digest: str,
        tokenizer_digest: str,
        dtype: str,
        quantization: str | None,
        kv_block_size: int,
        device: str = "cpu",
    ) -> Fingerprint:
        """The fingerprint of an engine running `config` with these settings."""
        return cls(
            architecture=config.architecture,
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            weights_digest=weights_digest,
            tokenizer_digest=tokenizer_digest,
            rope_type=config.rope_type,
            rope_theta=config.rope_theta,
            rope_scaling="none" if config.rope_scaling is None else config.rope_scaling.canonical(),
            dtype=dtype,
            quantization=quantization or "none",
            kv_block_size=kv_block_size,
            device=device,
        )

    def _fields(self) -> dict[str, Any]:
        data = asdict(self)
        if data["device"] == "cpu":
            del data["device"]
        return data

    def _canonical(self) -> str:
        return json.dumps(self._fields(), sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> str:
        """Stable hex digest (xxh3-128) over every field."""
        return xxhash.xxh3_128_hexdigest(self._canonical().encode())

    def diff(self, other: Fingerprint) -> dict[str, tuple[object, object]]:
        """Every field whose value differs: name -> (mine, theirs)."""
        out: dict[str, tuple[object, object]] = {}
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                out[f.name] = (mine, theirs)
        return out

    def check_compatible(self, other: Fingerprint, context: str = "") -> None:
        """Raise `FingerprintMismatch` naming every differing field unless all match."""
        differing = self.diff(other)
        if differing:
            raise FingerprintMismatch(differing, context)

    def to_dict(self) -> dict[str, Any]:
        """Wire form: every field plus `digest`, JSON-serializable."""
        data = self._fields()
        data["digest"] = self.digest
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fingerprint:
        """Parse the wire form; the `digest` entry, if present, must match the fields."""
        # Field annotations are strings under `from __future__ import annotations`.
        names = {f.name: str(f.type) for f in fields(cls)}
        unknown = set(data) - set(names) - {"digest"}
        if unknown:
            raise ConfigError(f"fingerprint: unknown fields {sorted(unknown)}")
        values: dict[str, Any] = {}
        for name, type_name in names.items():
            if name == "device" and name not in data:
                values[name] = "cpu"  # an older build's, or a CPU engine's, wire form
                continue
            if name not in data:
                raise ConfigError(f"fingerprint: field {name!r} missing")
            value: Any = data[name]
            if isinstance(value, bool) or not isinstance(value, _WIRE_TYPES[type_name]):
                raise ConfigError(f"fingerprint: field {name!r} has wrong type: {value!r}")
            values[name] = float(data[name]) if type_name == "float" else value
        result = cls(**values)
        if "digest" in data and data["digest"] != result.digest:
            raise ConfigError(
                f"fingerprint: digest {data['digest']!r} does not match its fields "
                f"({result.digest!r})"
            )
        return result
