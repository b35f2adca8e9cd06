"""A real agent framework against a dpserve node: OpenAI's Agents SDK (`openai-agents`).

Its chat-completions model drives the whole loop itself: it sends the tool's strict
JSON schema, runs the Python function with the call's arguments, sends the result
back as a `tool` message and takes the next answer as the final output. The demo
model (tools chat template, served with --enable-auto-tool-choice --tool-call-parser
hermes) calls no tool by itself, so the first turn is `tool_choice="required"`; the
SDK resets it to auto after the call (reset_tool_choice), as it does with any model.
The tool's arguments are bounded (an enum, a range) so that a random-weight model's
call ends well within max_tokens.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import pytest
from pydantic import Field

from tests.server import DpServer

agents = pytest.importorskip("agents")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dpserve.engine.testing.demo_model import create_demo_model

    model = create_demo_model(str(tmp_path_factory.mktemp("agent-model") / "model"), chat="tools")
    srv = DpServer(model, "--max-model-len", "1024", "--dtype", "float32",
                   "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def run_agent(server, tool_calls: list[dict], stream: bool):
    """One Runner.run (or run_streamed) of an agent with one function tool; returns the result."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI's servers

    @function_tool
    def get_weather(city: Literal["Paris", "Berlin", "Rome"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather forecast for a city.

        Args:
            city: The city's name.
            days: How many days ahead.
        """
        tool_calls.append({"city": city, "days": days})
        return f"Sunny in {city} for {days} days, 21 C."

    async def go():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        try:
            agent = Agent(
                name="forecaster", instructions="Answer weather questions with the get_weather tool.",
                tools=[get_weather],
                model=OpenAIChatCompletionsModel(model="demo", openai_client=client),
                model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                             temperature=0.7, include_usage=True, extra_body={**NO_THINKING, "seed": 3}),
            )
            question = "What is the weather in Paris this week?"
            if not stream:
                return await Runner.run(agent, question, max_turns=4)
            result = Runner.run_streamed(agent, question, max_turns=4)
            async for _ in result.stream_events():
                pass
            return result
        finally:
            await client.close()

    return asyncio.run(go())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_agent_completes_a_tool_round_trip(server, stream):
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    tool_calls: list[dict] = []
    result = run_agent(server, tool_calls, stream)
    # The SDK parsed the call's arguments against the tool's schema and ran the function once.
    assert len(tool_calls) == 1 and tool_calls[0]["city"] in ("Paris", "Berlin", "Rome") and 1 <= tool_calls[0]["days"] <= 7
    kinds = [type(item) for item in result.new_items]
    assert kinds[:2] == [ToolCallItem, ToolCallOutputItem] and kinds[-1] is MessageOutputItem, kinds
    assert result.new_items[1].output == f"Sunny in {tool_calls[0]['city']} for {tool_calls[0]['days']} days, 21 C."
    # Two model turns: the call, then the final answer with the call and its result in the prompt.
    assert len(result.raw_responses) == 2
    first, second = (r.usage for r in result.raw_responses)
    assert second.input_tokens > first.input_tokens + 10
    assert isinstance(result.final_output, str)
