"""The router's client-facing HTTP surface: OpenAI request and response bodies, validation into
a `Job`, streamed output (SSE, stop strings, logprobs), and vLLM's utility routes."""
