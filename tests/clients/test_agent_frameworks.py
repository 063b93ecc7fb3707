"""Agent frameworks, unmodified, against `pdserve up` (disaggregated): LangChain
(`langchain-openai`: `bind_tools` whole and streamed, `with_structured_output`) and the OpenAI
Agents SDK (an agent with two function tools whose tool loop runs to its end, a forced call
then the typed answer, over Chat Completions and over the Responses API). They run in their
own venv (.venv-clients/agents, `make client-venvs`) as scripts under scripts/, printing what
they saw as JSON."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from clients_support import SERVED, client_bin

SCRIPTS = Path(__file__).parent / "scripts"


def run_script(name: str, up: str) -> dict[str, object]:
    python = client_bin("agents", "python")
    done = subprocess.run([str(python), str(SCRIPTS / name), up, SERVED], capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_langchain_binds_tools_and_structured_output(up: str) -> None:
    seen = run_script("langchain_tools.py", up)
    for calls in (seen["whole"], seen["streamed"]):
        assert isinstance(calls, list) and len(calls) == 1
        [call] = calls
        assert call["name"] == "get_weather"  # the named choice, never `convert`
        assert call["args"]["city"] in ("Paris", "Tokyo") and call["args"]["days"] in (1, 2, 3)
    assert seen["streamed"] == seen["whole"]  # same seed: the same call, streamed or not
    assert isinstance(seen["chunks"], int) and seen["chunks"] > 3
    person = seen["person"]
    assert isinstance(person, dict)
    assert person["name"] in ("ada", "bob", "cy") and person["age_group"] in ("young", "old")


def test_agents_sdk_runs_a_tool_loop_to_its_end(up: str) -> None:
    seen = run_script("agents_loop.py", up)
    for api in ("chat", "responses"):
        run = seen[api]
        assert isinstance(run, dict), seen
        called = run["called"]
        # One forced call ran (parallel_tool_calls false), then the answer (tool_choice none
        # once a tool ran): the loop ended after two model calls with the agent's typed answer.
        assert isinstance(called, list) and len(called) == 1, run
        [[name, arg]] = called
        assert (name, arg) in {("get_weather", "Paris"), ("get_weather", "Tokyo"),
                               ("convert", "C"), ("convert", "F")}, run  # fmt: skip
        assert run["model_calls"] == 2, run
        final = run["final_output"]
        assert isinstance(final, dict), run
        assert final["city"] in ("Paris", "Tokyo") and final["sky"] in ("sunny", "rainy"), run
        assert final["unit"] in ("C", "F"), run
