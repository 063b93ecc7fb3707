"""Tool calling: tool specs and choices, the call formats models emit, and their parsing. Pure.

`spec` holds what a request declares (function tools, `tool_choice`); `formats` the text shape
of a call in one model family (Hermes `<tool_call>` tags, Llama 3 JSON) and the grammar that
forces it; `parser` turns generated text into content and OpenAI tool-call deltas as tokens
arrive; `messages` turns OpenAI chat messages with tool calls and tool results into what a chat
template renders. No torch, no I/O: the router uses all of it.
"""
