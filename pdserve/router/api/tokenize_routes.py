"""vLLM's utility endpoints on the router: POST /tokenize, POST /detokenize, GET /version,
and GET /tokenizer_info when the router is started with --enable-tokenizer-info-endpoint.

Same bodies as vLLM's server: /tokenize takes a `prompt` (with `add_special_tokens`, default
true) or chat `messages` (with `add_generation_prompt`, default true; encoded through the same
chat template as /v1/chat/completions) and answers `{count, max_model_len, tokens,
token_strs}`; /detokenize takes `tokens` and answers `{prompt}`; /version answers the package
version; /tokenizer_info answers the tokenizer's configuration as transformers holds it (the
keys of tokenizer_config.json, `added_tokens_decoder`, `tokenizer_class`) with the chat template
the router applies (a --chat-template override included). Bodies are strict like the OpenAI routes (an unknown field is a 400 naming it). No
worker is involved.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from pdserve.errors import InvalidRequest
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.api.chat_prompt import message_dicts, render_chat_prompt
from pdserve.router.api.json_body import read_object, validate
from pdserve.router.api.openai_models import ChatMessage, ToolDefinition
from pdserve.router.api.tool_request import function_tools


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None


class TokenizeRequest(_Body):
    """POST /tokenize: text, or chat messages."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # With messages: the tools the chat template renders (as /v1/chat/completions does).
    tools: list[ToolDefinition] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    # With messages: end the prompt inside the final message, for the model to continue it.
    continue_final_message: bool = False
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    tokens: list[int] = Field(min_length=0)


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def package_version() -> str:
    """pdserve's installed version ("unknown" when run from a bare checkout)."""
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown"


class TokenizeApi:
    """Handlers of /tokenize, /detokenize and /version."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, model_names: tuple[str, ...]):
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._model_names = model_names

    def add_routes(self, app: web.Application, tokenizer_info: bool = False) -> None:
        """Register the routes on `app`; GET /tokenizer_info only with `tokenizer_info`."""
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        if tokenizer_info:
            app.router.add_get("/tokenizer_info", self.tokenizer_info)

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize."""
        body = validate(TokenizeRequest, await read_object(request))
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("prompt: give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            # The prompt /v1/chat/completions would build: tool calls, results and tools too.
            text = render_chat_prompt(
                self._tokenizer,
                message_dicts(body.messages),
                function_tools(body.tools or []),
                body.add_generation_prompt,
                body.continue_final_message,
            )
            # The template writes its own special tokens (as vLLM's default for messages).
            ids = self._tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        else:
            assert body.prompt is not None
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = self._tokenizer.encode(body.prompt, add_special_tokens=add)
        strs = None
        if body.return_token_strs:
            strs = self._tokenizer.token_strs(ids)
        out = TokenizeResponse(
            count=len(ids), max_model_len=self._max_model_len, tokens=ids, token_strs=strs
        )
        # `token_strs` is null unless asked for (present, as in vLLM's answer).
        return web.json_response(text=out.model_dump_json())

    async def detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize."""
        body = validate(DetokenizeRequest, await read_object(request))
        self._check_model(body.model)
        vocab = self._tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"tokens: ids {bad[:5]} outside [0, {vocab})", "tokens")
        text = self._tokenizer.decode(body.tokens)
        return web.json_response(text=DetokenizeResponse(prompt=text).model_dump_json())

    async def version(self, request: web.Request) -> web.Response:
        """GET /version."""
        return web.json_response(text=VersionResponse(version=package_version()).model_dump_json())

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """GET /tokenizer_info: what vLLM answers from transformers' `init_kwargs`."""
        tok = self._tokenizer
        info: dict[str, Any] = dict(tok.tokenizer_config)
        # pdserve reads tokenizer.json, which transformers loads as its fast tokenizer.
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        info["added_tokens_decoder"] = tok.added_tokens()
        info.pop("chat_template", None)
        if tok.chat_template is not None:
            info["chat_template"] = tok.chat_template
        return web.json_response(info)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self._model_names:
            raise InvalidRequest(f"model: {model!r} is not served here", "model", "model_not_found")
