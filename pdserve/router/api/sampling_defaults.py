"""The model's own sampling defaults (generation_config.json), applied as vLLM applies them.

vLLM's server (`--generation-config auto`, its default) reads `temperature`, `top_p`, `top_k`,
`min_p`, `repetition_penalty` and `max_new_tokens` from the model's generation_config.json:
each is the default of the matching request field a client did not send (a field the client
sent, even with the API's own default value, wins), and `max_new_tokens` caps every request's
output length. `--generation-config vllm` ignores the file (the API's defaults). Pure: the
router reads the file once at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.errors import ModelConfigError
from pdserve.model.config import GENERATION_CONFIG_FILE, read_json_object

# generation_config.json key -> request field; the keys vLLM takes.
_FLOAT_KEYS = {"temperature": "temperature", "top_p": "top_p", "min_p": "min_p",
               "repetition_penalty": "repetition_penalty"}  # fmt: skip
_INT_KEYS = {"top_k": "top_k"}


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Request-field defaults from the model, and its cap on output tokens."""

    # Request field name -> the model's default for it (only the keys the file sets).
    fields: tuple[tuple[str, float | int], ...] = ()
    # The file's `max_new_tokens`: no request generates more; None: no cap.
    max_tokens: int | None = None

    def value(self, name: str, sent: set[str], given: Any) -> Any:
        """`given` if the client sent field `name`, else the model's default if it has one."""
        if name in sent:
            return given
        return dict(self.fields).get(name, given)

    def cap(self, max_tokens: int) -> int:
        """`max_tokens` capped at the model's `max_new_tokens`."""
        return max_tokens if self.max_tokens is None else min(max_tokens, self.max_tokens)


def read_sampling_defaults(folder: str | Path) -> SamplingDefaults:
    """The defaults in `folder`'s generation_config.json (none when it has no such keys);
    ModelConfigError naming a key whose value has the wrong type."""
    raw = read_json_object(Path(folder) / GENERATION_CONFIG_FILE, "generation config", False)
    fields: list[tuple[str, float | int]] = []
    for key, name in _FLOAT_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelConfigError(GENERATION_CONFIG_FILE, key, f"expected a number, got {value!r}")
        fields.append((name, float(value)))
    for key, name in _INT_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelConfigError(
                GENERATION_CONFIG_FILE, key, f"expected an integer, got {value!r}"
            )
        fields.append((name, value))
    cap = raw.get("max_new_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ModelConfigError(GENERATION_CONFIG_FILE, "max_new_tokens", f"got {cap!r}")
    return SamplingDefaults(tuple(fields), cap)
