"""The offline Python API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

A thin loop over one `Engine`: queue every prompt, step until all finish, return outputs in
prompt order. Mirrors vLLM's `LLM` so that scripts port with few changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.engine.engine import Engine
from pdserve.errors import ConfigError
from pdserve.protocol.sampling import SamplingParams
from pdserve.text.output import OutputStream


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One finished generation."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    # "stop" (EOS, stop token or stop string) or "length" (max_tokens).
    finish_reason: str
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int


class LLM:
    """Generate completions with one in-process engine."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "float32",
        quantization: str | None = None,
        device: str = "auto",
        **engine_options: object,
    ) -> None:
        """`device`: auto (CUDA when there is a GPU), cpu or cuda; `engine_options`: any
        `EngineConfig` field."""
        load = ModelLoadConfig(path=model, dtype=dtype, quantization=quantization, device=device)
        try:
            config = EngineConfig(model=load, **engine_options)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ConfigError(f"LLM: {exc}") from None
        self.engine = Engine.from_config(config)
        self.tokenizer = self.engine.model.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Complete every prompt (text or token ids); outputs in prompt order."""
        items: list[str | Sequence[int]] = [prompts] if isinstance(prompts, str) else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            per = [params or SamplingParams()] * len(items)
        else:
            per = list(params)
            if len(per) != len(items):
                raise ConfigError(f"generate: {len(per)} SamplingParams for {len(items)} prompts")
        token_lists = [
            self.tokenizer.encode(item) if isinstance(item, str) else [int(t) for t in item]
            for item in items
        ]
        ids: list[str] = []
        try:
            for tokens, p in zip(token_lists, per, strict=True):
                request_id = f"llm-{self._counter}"
                self._counter += 1
                self.engine.add_request(request_id, tokens, p)
                ids.append(request_id)
        except Exception:
            # One bad prompt refuses the whole call and leaves nothing queued behind.
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        # The stop rules (stop strings included: the engine checks none) and the text, applied
        # incrementally as the router applies them, so both give the same text.
        eos = self.engine.model.eos_token_ids
        outputs = {
            rid: OutputStream(self.tokenizer, p, eos) for rid, p in zip(ids, per, strict=True)
        }
        texts = dict.fromkeys(ids, "")
        finished: dict[str, CompletionOutput] = {}
        requests = {rid: self.engine.get_request(rid) for rid in ids}
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                rid = delta.request_id
                output = outputs[rid]
                if rid in finished:
                    continue
                texts[rid] += output.add_all(list(delta.new_token_ids))
                if delta.finished and not output.finished:
                    texts[rid] += output.finish(delta.finish_reason or "stop")
                if not output.finished:
                    continue
                if not delta.finished:
                    self.engine.abort(rid)  # a stop string ended it: the engine stops here
                r = requests[rid]
                finished[rid] = CompletionOutput(
                    rid,
                    r.prompt_token_ids,
                    list(output.token_ids),
                    texts[rid],
                    output.finish_reason or "stop",
                    r.num_cached_tokens,
                )
        return [finished[rid] for rid in ids]
