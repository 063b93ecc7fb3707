"""POST /v1/responses (OpenAI's Responses API) on top of the chat machinery.

A Responses request is translated into a chat request (`translate`), validated and run as one
(the same builder, tools, grammar, flows, recovery and migration), and its output rendered as
a Response object or the Responses stream's typed events (`render`). Stateless by default;
with the router's --enable-store, responses are kept (`store`) so `previous_response_id` can
continue a conversation.
"""
