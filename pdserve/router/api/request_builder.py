"""From a client's JSON body to a validated `Job`: fields, prompts, sampling, limits. Pure.

Order: top-level fields screened (`field_policy`: unknown and unimplemented fields refused,
naming them) → the endpoint's pydantic model → the model name → prompts as token ids (text,
token ids, a list of either; chat messages through the chat template, text content parts
joined) → sampling parameters (`SamplingParams` checks ranges; the message's first word is
the OpenAI `param`) → structured output compiled once here, so a schema the grammar library
rejects is a 400 naming the problem, never a worker error → context length per prompt.
Every refusal is an `InvalidRequest` (400) with `param` set.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from pdserve.engine.grammar import GrammarCompiler
from pdserve.errors import (
    GrammarError,
    GrammarUnavailable,
    InvalidRequest,
    SamplingParamsError,
)
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling import MAX_LOGPROBS, GrammarKind, GrammarSpec, SamplingParams
from pdserve.router.api import field_policy
from pdserve.router.api.chat_prompt import message_dicts, render_chat_prompt
from pdserve.router.api.json_body import validate
from pdserve.router.api.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from pdserve.router.api.responses import Job, PromptInput
from pdserve.router.api.sampling_defaults import SamplingDefaults
from pdserve.router.api.tool_request import ToolGrammars, tool_request
from pdserve.tools.formats import HERMES, ToolFormat

# Choices one request may ask for (n, or best_of), and prompts one request may carry.
MAX_CHOICES = 64
MAX_PROMPTS = 256
_SEED_LIMIT = 1 << 63
_M = TypeVar("_M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class BuilderConfig:
    """What the builder needs from the router's configuration."""

    # Names a request's `model` may use (--served-model-name, else the model folder's name).
    model_names: tuple[str, ...]
    # Longest prompt + output (the model's, or --max-model-len).
    max_model_len: int
    # Drop unknown top-level fields instead of refusing them (--allow-unknown-fields).
    allow_unknown_fields: bool = False
    # The shape of tool calls in this model's output (--tool-call-parser).
    tool_format: ToolFormat = HERMES
    # The model's sampling defaults (generation_config.json; none with --generation-config vllm).
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # Logprob tokens as `token_id:N` when a request does not say (--return-tokens-as-token-ids).
    return_tokens_as_token_ids: bool = False


class RequestBuilder:
    """Builds jobs for one tokenizer and configuration."""

    def __init__(self, config: BuilderConfig, tokenizer: Tokenizer) -> None:
        self._config = config
        self._tokenizer = tokenizer
        self._grammars = GrammarCompiler(
            tokenizer.to_json, tokenizer.vocab_size, tokenizer.eos_token_ids
        )
        self._tool_grammars = ToolGrammars(self._grammars, config.tool_format)

    def completion(self, data: dict[str, Any]) -> Job:
        """A POST /v1/completions body as a job."""
        body = self._validate(data, CompletionRequest, "completion")
        prompts = self._prompts(body.prompt)
        echo_only = body.max_tokens == 0
        if echo_only and not body.echo:
            raise InvalidRequest("max_tokens: 0 is only allowed with echo", "max_tokens")
        max_tokens = 1 if echo_only else self._config.defaults.cap(_or(body.max_tokens, 16))
        best_of = _or(body.best_of, body.n)
        if not body.n <= best_of <= MAX_CHOICES:
            raise InvalidRequest(
                f"best_of: must be in [n={body.n}, {MAX_CHOICES}], got {best_of}", "best_of"
            )
        if body.stream and best_of > body.n:
            raise InvalidRequest("best_of: must equal n when streaming", "best_of")
        # best_of ranks samples by total logprob: they are needed even if not returned.
        logprobs = body.logprobs if best_of == body.n else max(body.logprobs or 0, 0)
        _check_prompt_logprobs(body.prompt_logprobs, body.stream)
        # The worker computes the prompt's alternatives once, for echo and prompt_logprobs
        # both (each answer is trimmed to what it asked for).
        asked = [v for v in (body.logprobs if body.echo else None, body.prompt_logprobs)
                 if v is not None]  # fmt: skip
        prompt_logprobs = max(asked) if asked else None
        sampling = self._sampling(body, max_tokens, logprobs, self._grammar(body), prompt_logprobs)
        for p in prompts:
            self._check_context(p, max_tokens, "prompt")
        job = self._job("completion", "cmpl", body, prompts, sampling, best_of,
                        _width(body, body.logprobs), body.echo, echo_only)  # fmt: skip
        job.prompt_logprobs = body.prompt_logprobs
        return job

    def chat(self, data: dict[str, Any], request_id: str | None = None) -> Job:
        """A POST /v1/chat/completions body as a job (`request_id`: its id, else a new one)."""
        body = self._validate(data, ChatCompletionRequest, "chat")
        tools = tool_request(body)
        answer = self._grammar(body)
        grammar = self._tool_grammars.check(tools, answer) if tools is not None else answer
        dicts = message_dicts(body.messages)
        text = render_chat_prompt(
            self._tokenizer,
            dicts,
            tools.tools if tools is not None else None,
            body.add_generation_prompt,
            body.continue_final_message,
        )
        # The template writes its own special tokens.
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        prompt = PromptInput(ids, "")
        # OpenAI's default for chat is "until the context is full".
        default = max(self._config.max_model_len - len(ids), 1)
        max_tokens = _or(body.max_completion_tokens, _or(body.max_tokens, default))
        max_tokens = self._config.defaults.cap(max_tokens)
        # An error about the output limit names the field the client actually sent.
        limit = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs: needs logprobs set to true", "top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            # Checked here so the 400 names the chat field (sampling calls it `logprobs`).
            raise InvalidRequest(
                f"top_logprobs: must be an integer in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
                "top_logprobs",
            )
        top = (body.top_logprobs or 0) if body.logprobs else None
        _check_prompt_logprobs(body.prompt_logprobs, body.stream)
        sampling = self._sampling(body, max_tokens, top, grammar, body.prompt_logprobs, limit)
        self._check_context(prompt, max_tokens, "messages", limit)
        job = self._job(
            "chat", "chatcmpl", body, [prompt], sampling, body.n, _width(body, top), False, False
        )
        job.request_id = request_id or job.request_id
        job.role = answer_role(body, dicts)
        job.prompt_logprobs = body.prompt_logprobs
        job.chat_echo = _chat_echo(body, dicts)
        if tools is not None and tools.parsed:
            job.tool_format = self._config.tool_format
        return job

    # ---- parts -----------------------------------------------------------------------------

    def _validate(self, data: dict[str, Any], model: type[_M], kind: str) -> _M:
        kept = field_policy.screen(data, model, kind, self._config.allow_unknown_fields)
        body = validate(model, kept)
        assert isinstance(body, SamplingFields)
        if body.model not in self._config.model_names:
            raise InvalidRequest(
                f"model: {body.model!r} is not served here (serving"
                f" {', '.join(repr(n) for n in self._config.model_names)})",
                "model",
                "model_not_found",
            )
        if body.return_tokens_as_token_ids is None:
            body.return_tokens_as_token_ids = self._config.return_tokens_as_token_ids
        if not 1 <= body.n <= MAX_CHOICES:
            raise InvalidRequest(f"n: must be in [1, {MAX_CHOICES}], got {body.n}", "n")
        if body.stream_options is not None and not body.stream:
            # As vLLM (and OpenAI): the options of a stream on a request that is not one.
            raise InvalidRequest(
                "stream_options: only allowed when stream is true", "stream_options"
            )
        return body

    def _prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptInput]:
        if isinstance(prompt, str):
            items: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            items = [list(prompt)]  # type: ignore[arg-type]
        else:
            items = list(prompt)  # type: ignore[arg-type]
        if not items or len(items) > MAX_PROMPTS:
            raise InvalidRequest(
                f"prompt: must hold 1 to {MAX_PROMPTS} prompts, got {len(items)}", "prompt"
            )
        prompts = []
        vocab = self._tokenizer.vocab_size
        for i, item in enumerate(items):
            where = "prompt" if len(items) == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                if not item:
                    raise InvalidRequest(f"{where}: must not be empty", "prompt")
                prompts.append(PromptInput(self._tokenizer.encode(item), item))
                continue
            bad = [t for t in item if not 0 <= t < vocab]
            if not item or bad:
                raise InvalidRequest(
                    f"{where}: token ids must be a non-empty list in [0, {vocab}), got"
                    f" {bad[:5] or 'an empty list'}",
                    "prompt",
                )
            prompts.append(PromptInput(item, self._tokenizer.decode(item)))
        return prompts

    def _sampling(
        self,
        body: SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        grammar: GrammarSpec | None,
        prompt_logprobs: int | None = None,
        limit_param: str = "max_tokens",
    ) -> SamplingParams:
        if body.seed is not None and not 0 <= body.seed < _SEED_LIMIT:
            raise InvalidRequest(f"seed: must be in [0, 2**63), got {body.seed}", "seed")
        # What the client did not send comes from the model's generation_config (as vLLM).
        sent, model = body.model_fields_set, self._config.defaults
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=model.value("temperature", sent, body.temperature),
                top_k=model.value("top_k", sent, body.top_k),
                top_p=model.value("top_p", sent, body.top_p),
                min_p=model.value("min_p", sent, body.min_p),
                # Drawn here when absent, so the prefill, decode and any migration target all
                # sample with one seed: a replay then continues the same random stream.
                seed=body.seed if body.seed is not None else secrets.randbits(63),
                stop=tuple(body.stop_list()),
                stop_token_ids=tuple(self._token_ids(body.stop_token_ids or [], "stop_token_ids")),
                ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=model.value("repetition_penalty", sent, body.repetition_penalty),
                logit_bias=self._logit_bias(body.logit_bias),
                logprobs=logprobs,
                logprob_token_ids=tuple(
                    self._token_ids(body.logprob_token_ids or [], "logprob_token_ids")
                ),
                prompt_logprobs=prompt_logprobs,
                grammar=grammar,
            )
        except SamplingParamsError as exc:
            param, _, rest = str(exc).partition(":")
            if param == "max_tokens":
                raise InvalidRequest(f"{limit_param}:{rest}", limit_param) from exc
            raise InvalidRequest(str(exc), param) from exc
        return params

    def _token_ids(self, ids: Collection[int], param: str) -> list[int]:
        vocab = self._tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"{param}: token ids {bad[:5]} outside [0, {vocab})", param)
        return list(ids)

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        if not bias:
            return ()
        pairs = []
        bad = []
        for key, value in bias.items():
            try:
                pairs.append((int(key), value))
            except ValueError:
                bad.append(key)
        if bad:
            # Every bad key at once (as vLLM), so a client fixes them in one round.
            raise InvalidRequest(f"logit_bias: keys must be token ids, got {bad!r}", "logit_bias")
        self._token_ids([t for t, _ in pairs], "logit_bias")
        return tuple(sorted(pairs))

    def _grammar(self, body: SamplingFields) -> GrammarSpec | None:
        """The structured output the body asks for, compiled once (400 naming the field)."""
        specs: list[tuple[str, GrammarSpec]] = []
        fmt = body.response_format
        if fmt is not None and fmt.type == "json_object":
            specs.append(
                ("response_format", GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type":"object"}'))
            )
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise InvalidRequest(
                    "response_format: type json_schema needs json_schema.schema",
                    "response_format",
                )
            source = json.dumps(fmt.json_schema.json_schema)
            specs.append(("response_format", GrammarSpec(GrammarKind.JSON_SCHEMA, source)))
        specs += _guided_specs(
            "guided_", body.guided_json, body.guided_regex, body.guided_choice, body.guided_grammar
        )
        structured = body.structured_outputs
        if structured is not None:
            # Named as one field: the client sent one object, whichever key it set.
            found = _guided_specs(
                "", structured.json_schema, structured.regex, structured.choice, structured.grammar
            )
            if structured.json_object:
                found.append(("", GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type":"object"}')))
            specs += [("structured_outputs", spec) for _, spec in found]
        if not specs:
            return None
        if len(specs) > 1:
            names = ", ".join(name for name, _ in specs)
            raise InvalidRequest(f"{specs[1][0]}: only one of {names} may be given", specs[1][0])
        param, spec = specs[0]
        try:
            self._grammars.check(spec)
        except (GrammarError, GrammarUnavailable) as exc:
            raise InvalidRequest(f"{param}: {exc}", param, "invalid_grammar") from exc
        return spec

    def _check_context(
        self, prompt: PromptInput, max_tokens: int, param: str, limit_param: str = "max_tokens"
    ) -> None:
        limit = self._config.max_model_len
        n = len(prompt.token_ids)
        if n >= limit:
            raise InvalidRequest(
                f"{param}: the prompt has {n} tokens; this model's context is {limit} tokens"
                " (max_model_len)",
                param,
                "context_length_exceeded",
            )
        if n + max_tokens > limit:
            raise InvalidRequest(
                f"{limit_param}: prompt ({n} tokens) + {limit_param} ({max_tokens}) exceeds"
                f" this model's context of {limit} tokens",
                limit_param,
                "context_length_exceeded",
            )

    def _job(
        self,
        kind: str,
        prefix: str,
        body: SamplingFields,
        prompts: list[PromptInput],
        sampling: SamplingParams,
        best_of: int,
        top_logprobs: int | None,
        echo: bool,
        echo_only: bool,
    ) -> Job:
        return Job(
            kind=kind,
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            body=body,
            prompts=prompts,
            sampling=sampling,
            best_of=best_of,
            top_logprobs=top_logprobs,
            echo=echo,
            echo_only=echo_only,
        )


def _width(body: SamplingFields, top: int | None) -> int | None:
    """How many alternatives a token's logprobs show: `top`, or with `logprob_token_ids` the
    chosen token and those (None: no logprobs)."""
    if top is None or not body.logprob_token_ids:
        return top
    return len(set(body.logprob_token_ids)) + 1


def _check_prompt_logprobs(prompt_logprobs: int | None, stream: bool) -> None:
    """`prompt_logprobs` come in the whole answer only: with `stream` a 400 (vLLM refuses
    N > 0 and silently answers none for 0; pdserve refuses both rather than drop them)."""
    if prompt_logprobs is not None and stream:
        raise InvalidRequest(
            "prompt_logprobs: not available with stream (send the request unstreamed)",
            "prompt_logprobs",
        )


def _guided_specs(
    prefix: str,
    json_schema: dict[str, Any] | str | None,
    regex: str | None,
    choice: list[str] | None,
    grammar: str | None,
) -> list[tuple[str, GrammarSpec]]:
    """The grammars vLLM's guided fields (`guided_json`, ...; or `structured_outputs`' keys)
    ask for, each with its field name (`prefix` + key)."""
    specs: list[tuple[str, GrammarSpec]] = []
    if json_schema is not None:
        source = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        specs.append((prefix + "json", GrammarSpec(GrammarKind.JSON_SCHEMA, source)))
    if regex is not None:
        specs.append((prefix + "regex", GrammarSpec(GrammarKind.REGEX, regex)))
    if choice is not None:
        specs.append((prefix + "choice", GrammarSpec(GrammarKind.CHOICE, json.dumps(choice))))
    if grammar is not None:
        specs.append((prefix + "grammar", GrammarSpec(GrammarKind.GRAMMAR, grammar)))
    return specs


def answer_role(body: ChatCompletionRequest, messages: Sequence[dict[str, Any]]) -> str:
    """The role of each choice's message, as vLLM names it: "assistant" when the prompt opens
    an assistant turn (add_generation_prompt), else the final message's role (the model
    continues that message's turn)."""
    if body.add_generation_prompt or not messages:
        return "assistant"
    return str(messages[-1]["role"])


def _chat_echo(body: ChatCompletionRequest, messages: Sequence[dict[str, Any]]) -> str:
    """With `echo`, the text each chat choice starts with, as vLLM echoes it: the final
    message's, if its role is the answer's (so always with add_generation_prompt false)."""
    if not body.echo or not messages:
        return ""
    last = messages[-1]
    content = last.get("content")
    return (
        content
        if last.get("role") == answer_role(body, messages) and isinstance(content, str)
        else ""
    )


def _or(value: int | None, default: int) -> int:
    return default if value is None else value
