"""Run in the agents venv: an OpenAI Agents SDK agent with two function tools against pdserve,
once over Chat Completions and once over the Responses API (the SDK's default). Prints one
JSON object per API: the tools the loop called, the model calls it made, the final output.
Usage: python agents_loop.py URL MODEL"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import replace
from typing import Any, Literal

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunHooks,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from pydantic import BaseModel

url, model = sys.argv[1], sys.argv[2]
SEED = int(sys.argv[3]) if len(sys.argv) > 3 else 1
set_tracing_disabled(True)
called: list[list[str]] = []


@function_tool
def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
    """The weather in a city."""
    called.append(["get_weather", city])
    return f"sunny, 24 C in {city}"


@function_tool
def convert(unit: Literal["C", "F"]) -> str:
    """Convert the last temperature."""
    called.append(["convert", unit])
    return "75 F" if unit == "F" else "24 C"


class AnswerOnceToolsRan(RunHooks[Any]):
    """After the first tool result, the agent's next turn may only answer (tool_choice none)."""

    async def on_tool_end(self, context: Any, agent: Agent[Any], tool: Any, result: str) -> None:
        agent.model_settings = replace(agent.model_settings, tool_choice="none")


class Forecast(BaseModel):
    city: Literal["Paris", "Tokyo"]
    sky: Literal["sunny", "rainy"]
    unit: Literal["C", "F"]


async def run(api: str) -> dict[str, object]:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model_impl = (
        OpenAIChatCompletionsModel(model=model, openai_client=client)
        if api == "chat"
        else OpenAIResponsesModel(model=model, openai_client=client)
    )
    # The first turn must call a tool and, once it ran, the next must answer: the loop ends
    # after two model calls whatever the random model samples. (The SDK's own guard resets a
    # forced choice to auto, where the random weights may call tools until the context is
    # full: in a try of 12 seeds, 11 did; pdserve's auto-or-JSON grammar has unit tests.)
    agent = Agent(
        name="weather",
        instructions="Answer weather questions with the tools.",
        tools=[get_weather, convert],
        model=model_impl,
        output_type=Forecast,
        reset_tool_choice=False,
        model_settings=ModelSettings(
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            max_tokens=200,
            extra_body={"seed": SEED},
        ),
    )
    called.clear()
    result = await Runner.run(
        agent, "What is the weather in Tokyo, in F?", max_turns=4, hooks=AnswerOnceToolsRan()
    )
    return {"called": list(called), "model_calls": len(result.raw_responses),
            "final_output": result.final_output.model_dump()}  # fmt: skip


print(json.dumps({api: asyncio.run(run(api)) for api in ("chat", "responses")}))
