"""Run in the agents venv: LangChain's ChatOpenAI against pdserve. Prints one JSON object:
the tool calls `bind_tools` produced (whole and streamed) and `with_structured_output`'s
instance. Usage: python langchain_tools.py URL MODEL"""

from __future__ import annotations

import json
import sys
from typing import Literal

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

url, model = sys.argv[1], sys.argv[2]
llm = ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model=model, temperature=0.7,
                 seed=3, max_tokens=120, max_retries=0)  # fmt: skip


@tool
def get_weather(city: Literal["Paris", "Tokyo"], days: Literal[1, 2, 3]) -> str:
    """The weather forecast for a city."""
    return f"sunny in {city} for {days} days"


@tool
def convert(unit: Literal["C", "F"]) -> str:
    """Convert a temperature."""
    return unit


class Person(BaseModel):
    name: Literal["ada", "bob", "cy"]
    age_group: Literal["young", "old"]
    likes_tea: bool


bound = llm.bind_tools([get_weather, convert], tool_choice="get_weather")
whole = bound.invoke("What is the weather in Paris for two days?")
chunks = list(bound.stream("What is the weather in Paris for two days?"))
streamed = chunks[0]
for chunk in chunks[1:]:
    streamed = streamed + chunk
person = llm.with_structured_output(Person).invoke("Describe a person")
print(
    json.dumps(
        {
            "whole": [{"name": c["name"], "args": c["args"]} for c in whole.tool_calls],
            "streamed": [{"name": c["name"], "args": c["args"]} for c in streamed.tool_calls],  # type: ignore[attr-defined]
            "chunks": len(chunks),
            "person": person.model_dump(),  # type: ignore[union-attr]
        }
    )
)
