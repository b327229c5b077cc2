"""Tool calling through the openai SDK, on the fake engine: it echoes its prompt, so a user message holding
Qwen's `<tool_call>` text is a reply that calls, produced deterministically."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

from omnistage.server import build_app
from omnistage.server.formats import ToolChatFormat
from omnistage.server.responses import Usage

MODEL = "fake-model"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALLS = (
    'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


@pytest.fixture
def client(fake_pipeline) -> openai.OpenAI:
    http = TestClient(build_app(fake_pipeline, MODEL))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def ask(client, content, **fields):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=500,
        tools=[WEATHER],
        **fields,
    )


def test_a_reply_that_calls_comes_back_as_tool_calls(client):
    reply = ask(client, CALLS)
    choice = reply.choices[0]
    assert (
        choice.finish_reason == "length"
    )  # the fake ends every reply by its length, and a cut reply says so
    assert choice.message.content == "Checking."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}),
        ("function", "get_weather", {"city": "Oslo"}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


def test_streamed_calls_reassemble_as_the_sdk_accumulates_them(client):
    with client.chat.completions.stream(
        model=MODEL, messages=[{"role": "user", "content": CALLS}], max_tokens=500, tools=[WEATHER]
    ) as stream:
        first_deltas = [
            e.chunk.choices[0].delta.tool_calls[0]
            for e in stream
            if e.type == "chunk" and e.chunk.choices and e.chunk.choices[0].delta.tool_calls
        ]
        final = stream.current_completion_snapshot  # the SDK's own accumulation of the deltas
    assert first_deltas[0].function.name == "get_weather" and first_deltas[0].id.startswith("call_")
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "length"
    assert message.content == "Checking."
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [
        {"city": "Paris"},
        {"city": "Oslo"},
    ]


def test_malformed_call_text_stays_content(client):
    text = "<tool_call>\nnot json\n</tool_call>"
    reply = ask(client, text)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].message.tool_calls is None


def test_tool_choice_none_leaves_the_text_as_it_is(client):
    reply = ask(client, CALLS, tool_choice="none")
    assert reply.choices[0].message.content == CALLS
    assert reply.choices[0].message.tool_calls is None


def test_a_tool_round_trip_in_the_history(client):
    first = ask(client, CALLS)
    call = first.choices[0].message.tool_calls[0]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=500, tools=[WEATHER])
    assert reply.choices[0].message.content.endswith('{"temp": 21}')  # the echo of the rendered history


def test_a_reply_that_ends_after_calling_finishes_with_tool_calls():
    fmt = ToolChatFormat("chatcmpl-1", MODEL, include_usage=False)
    usage = Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    assert fmt.response(CALLS, "stop", usage)["choices"][0]["finish_reason"] == "tool_calls"
    assert fmt.response("no call", "stop", usage)["choices"][0]["finish_reason"] == "stop"
    streamed = ToolChatFormat("chatcmpl-2", MODEL, include_usage=False)
    chunks = streamed.delta(CALLS, "stop") + streamed.closing("stop")
    assert json.loads(chunks[-1].removeprefix("data: "))["choices"][0]["finish_reason"] == "tool_calls"


def test_langchain_bind_tools_reads_the_calls(fake_pipeline):
    llm = ChatOpenAI(
        model=MODEL,
        base_url="http://testserver/v1",
        api_key="none",
        http_client=TestClient(build_app(fake_pipeline, MODEL)),
        max_retries=0,
        max_tokens=500,
    ).bind_tools([WEATHER])
    first = llm.invoke([HumanMessage(CALLS)])
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    answers = [ToolMessage('{"temp": 21}', tool_call_id=c["id"]) for c in first.tool_calls]
    second = llm.invoke([HumanMessage("Weather?"), first, *answers])
    assert second.content.endswith('{"temp": 21}')
    assert second.tool_calls == []


def test_litellm_tool_calling(client, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list from the network
    import litellm

    reply = litellm.completion(
        model=f"openai/{MODEL}",
        messages=[{"role": "user", "content": CALLS}],
        tools=[WEATHER],
        max_tokens=500,
        api_key="none",
        client=client,
    )
    calls = reply.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]


@pytest.mark.parametrize(
    ("choice", "parallel", "names", "expect_parallel"),
    [
        ("required", None, ["get_weather", "get_time"], True),
        ("required", False, ["get_weather", "get_time"], False),
        ({"type": "function", "function": {"name": "get_time"}}, None, ["get_time"], False),
        ("auto", None, None, None),
    ],
)
def test_the_request_carries_the_constraint_of_its_tool_choice(
    fake_pipeline, client, monkeypatch, choice, parallel, names, expect_parallel
):
    seen = []
    generate = fake_pipeline.generate

    def recording(request, preparing=None):
        seen.append(request.params.structured)
        return generate(request, preparing)

    monkeypatch.setattr(fake_pipeline, "generate", recording)
    time = {"type": "function", "function": {"name": "get_time"}}
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    ask_tools = [WEATHER, time]
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        tools=ask_tools,
        tool_choice=choice,
        **extra,
    )
    if names is None:
        assert seen == [None]
        return
    (structured,) = seen
    assert [t.name for t in structured.tools] == names
    assert structured.parallel_tool_calls is expect_parallel
    if "get_weather" in names:
        assert json.loads(structured.tools[0].parameters) == WEATHER["function"]["parameters"]


def test_each_of_n_choices_parses_its_own_calls(client):
    reply = ask(client, CALLS, n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert [json.loads(c.function.arguments)["city"] for c in choice.message.tool_calls] == [
            "Paris",
            "Oslo",
        ]
    chunks = list(ask(client, CALLS, n=2, stream=True))
    names = {
        (chunk.choices[0].index, call.index): call.function.name
        for chunk in chunks
        for call in chunk.choices[0].delta.tool_calls or ()
        if call.function.name
    }
    assert names == {(i, k): "get_weather" for i in (0, 1) for k in (0, 1)}
