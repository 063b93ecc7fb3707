"""Text <-> token ids for one model folder (`tokenizer.json`, `tokenizer_config.json`, template).

BOS rule: when `tokenizer_config.json` sets `add_bos_token`, that flag decides and the
tokenizer's own post-processor is bypassed (so BOS is never added twice); when it is absent (e.g.
Llama 3, Qwen2) the post-processor of `tokenizer.json` decides, as transformers does. Chat
prompts are rendered by the template (which writes any BOS itself) and encoded with no special
tokens added.

The chat template runs in Jinja2's immutable sandbox: a template comes with a downloaded model
and must not reach Python objects.

`IncrementalDetokenizer` turns a token stream into text deltas whose concatenation equals the
full decode, and never emits a U+FFFD that a later token would have completed into a character.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from pdserve.errors import ModelConfigError, ModelFileMissing
from pdserve.model.config import read_json_object

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# transformers >= 4.50 may save the template in its own file instead of tokenizer_config.json.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_REPLACEMENT = "\ufffd"


class Tokenizer:
    """Encode, decode and chat-format text for one model."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise ModelFileMissing(str(path), "tokenizer")
        raw = path.read_bytes()
        try:
            self._tok = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise ModelConfigError(
                TOKENIZER_FILE, "<file>", f"not a valid tokenizer: {exc}"
            ) from exc
        config = read_json_object(
            folder / TOKENIZER_CONFIG_FILE, "tokenizer config", required=False
        )
        # tokenizer_config.json as read (GET /tokenizer_info serves it, as vLLM serves
        # transformers' init_kwargs).
        self.tokenizer_config: dict[str, Any] = config
        template_path = folder / CHAT_TEMPLATE_FILE
        template_text = template_path.read_text("utf-8") if template_path.is_file() else None
        self.chat_template = _chat_template(config) or template_text
        self.bos_token = _token_text(config, "bos_token")
        self.eos_token = _token_text(config, "eos_token")
        add_bos = config.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ModelConfigError(TOKENIZER_CONFIG_FILE, "add_bos_token", f"got {add_bos!r}")
        self.add_bos_token: bool | None = add_bos
        self.bos_token_id = self._token_id("bos_token", self.bos_token)
        eos_id = self._token_id("eos_token", self.eos_token)
        self.eos_token_ids: tuple[int, ...] = () if eos_id is None else (eos_id,)
        if self.add_bos_token and self.bos_token_id is None:
            raise ModelConfigError(
                TOKENIZER_CONFIG_FILE, "bos_token", "add_bos_token is true but no BOS token is set"
            )
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.digest = _digest(raw, config, template_text)

    def _token_id(self, field: str, text: str | None) -> int | None:
        if text is None:
            return None
        token_id = self._tok.token_to_id(text)
        if token_id is None:
            raise ModelConfigError(
                TOKENIZER_CONFIG_FILE, field, f"{text!r} is not in the {TOKENIZER_FILE} vocabulary"
            )
        return token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS per the module's BOS rule when add_special_tokens."""
        if self.add_bos_token is None:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (for libraries that build their own)."""
        return str(self._tok.to_str())

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; bytes that do not form UTF-8 become U+FFFD."""
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...])."""
        if self.chat_template is None:
            raise ModelConfigError(TOKENIZER_CONFIG_FILE, "chat_template", "no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        # Templates written for transformers expect its `tojson` (no HTML escaping of < > &,
        # non-ASCII kept), not Jinja's.
        env.filters["tojson"] = _tojson
        try:
            template = env.from_string(self.chat_template)
            return template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except TemplateError as exc:
            raise ModelConfigError(TOKENIZER_CONFIG_FILE, "chat_template", str(exc)) from exc

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of the rendered chat prompt (the template supplies any BOS); `tools` as
        transformers passes them (`{"type": "function", "function": {...}}` each); with
        `continue_final_message`, the prompt ends inside the final message (as transformers
        cuts it: just after that message's text), for the model to continue it."""
        text = self.render_chat(messages, add_generation_prompt, tools, continue_final_message)
        return self.encode(text, add_special_tokens=False)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The text `encode_chat` encodes (for /tokenize, which may add special tokens)."""
        extra = {"tools": list(tools)} if tools else {}
        text = self.apply_chat_template(messages, add_generation_prompt, **extra)
        if continue_final_message and messages:
            text = _open_final_message(text, messages[-1])
        return text

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry as stored (byte-level pieces such as "Ġworld" kept as
        they are), as transformers' `convert_ids_to_tokens` gives them."""
        return [self._tok.id_to_token(t) or "" for t in token_ids]

    def added_tokens(self) -> dict[str, dict[str, Any]]:
        """The vocabulary's added tokens by id (as a string), each as transformers serializes
        an AddedToken in `added_tokens_decoder`."""
        return {
            str(token_id): {
                "content": t.content,
                "lstrip": t.lstrip,
                "normalized": t.normalized,
                "rstrip": t.rstrip,
                "single_word": t.single_word,
                "special": t.special,
            }
            for token_id, t in sorted(self._tok.get_added_tokens_decoder().items())
        }

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer over this tokenizer."""
        return IncrementalDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    """Feed token ids one at a time; get the text each one adds.

    Decodes a short window `ids[prefix_offset:]` and returns what it adds beyond
    `ids[prefix_offset:read_offset]` (the text already emitted from that window). Decoding from a
    few tokens back, rather than the new token alone, lets decoders that treat the first token
    specially (leading-space stripping, byte fallback) see their context. A window ending in
    U+FFFD is held back: the next token may complete the character. `flush` releases whatever
    is held once the stream ends, so the deltas always concatenate to the full decode.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _window(self, end: int) -> str:
        return self._tokenizer.decode(self.token_ids[self._prefix_offset : end], self._skip)

    def add(self, token_id: int) -> str:
        """Append one token; return the new text ("" while a character is incomplete)."""
        self.token_ids.append(token_id)
        emitted = self._window(self._read_offset)
        text = self._window(len(self.token_ids))
        if text.endswith(_REPLACEMENT) or len(text) <= len(emitted):
            return ""
        # Advance the window: the next decode starts where this emitted text started.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return text[len(emitted) :]

    def flush(self) -> str:
        """Text still held back (a trailing incomplete character, rendered as U+FFFD)."""
        emitted = self._window(self._read_offset)
        text = self._window(len(self.token_ids))
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return text[len(emitted) :]


def _token_text(config: dict[str, Any], field: str) -> str | None:
    # A plain string, or a serialized AddedToken {"content": ..., ...}.
    value = config.get(field)
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise ModelConfigError(TOKENIZER_CONFIG_FILE, field, f"expected a token string, got {value!r}")


def _chat_template(config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    # Older configs store named templates: [{"name": "default", "template": ...}, ...].
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None or isinstance(template, str):
        return template
    raise ModelConfigError(TOKENIZER_CONFIG_FILE, "chat_template", "expected a template string")


def _digest(tokenizer_json: bytes, config: dict[str, Any], template: str | None) -> str:
    """xxh3-128 of tokenizer.json's bytes, the normalized config and any template file."""
    hasher = xxhash.xxh3_128(tokenizer_json)
    hasher.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    if template is not None:
        hasher.update(template.encode())
    return hasher.hexdigest()


def _open_final_message(rendered: str, final: Mapping[str, Any]) -> str:
    """`rendered` cut just after the final message's text (its last text part's), whatever
    the template wrote after it; ModelConfigError if the template did not render that text."""
    content = final.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, Mapping) and p.get("text")]
        content = texts[-1] if texts else ""
    text = str(content or "")
    for needle in (text, text.strip()):
        at = rendered.rfind(needle) if needle else -1
        if at >= 0:
            return rendered[: at + len(needle)]
    raise ModelConfigError(
        TOKENIZER_CONFIG_FILE, "chat_template",
        "continue_final_message: the final message's text is not in the rendered chat",
    )  # fmt: skip


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)
