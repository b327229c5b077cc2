"""A live `omnistage serve` (tiny checkpoint, CPU) answering the Responses API through the openai SDK: whole
and streamed responses validated strictly against the SDK's types, an image or a clip in the input, a
conversation continued by previous_response_id (its prompt holds the earlier turn), GET and DELETE by id,
and refusals in OpenAI's shape naming the field."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from openai_types import strictly
from PIL import Image

from omnistage.models.qwen3_omni.processor import Processor
from tests.server.conftest import SHARED_MODEL

SPEECH = Path(__file__).parents[1] / "data" / "speech_en.wav"
FORCED = {"ignore_eos": True}  # vLLM's extra: random weights say exactly max_output_tokens


@pytest.fixture(scope="module")
def server(shared_server):  # it keeps 3 stored responses
    return shared_server


@pytest.fixture(scope="module")
def model() -> str:
    return SHARED_MODEL


@pytest.fixture(scope="module")
def processor(tiny_checkpoint) -> Processor:
    return Processor(tiny_checkpoint)


def prompt_tokens(processor: Processor, messages: list[dict[str, Any]]) -> int:
    return len(processor.encode(processor.render_chat(messages)))


def create(client: openai.OpenAI, **fields: Any) -> Response:
    """responses.create, its body validated strictly."""
    raw = client.responses.with_raw_response.create(**fields)
    return strictly(Response, raw.http_response.json())


def test_a_response_reads_as_the_sdks_and_counts_its_prompt(client, model, processor):
    response = create(
        client, model=model, instructions="Be terse.", input="Name a river.", max_output_tokens=5,
        temperature=0, metadata={"k": "v"}, extra_body=FORCED,
    )  # fmt: skip
    assert response.id.startswith("resp_") and response.object == "response" and response.model == model
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].text
    assert response.output_text == message.content[0].text
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a river."}]
    assert response.usage.input_tokens == prompt_tokens(processor, messages)
    assert (
        response.usage.output_tokens == 5 and response.usage.total_tokens == response.usage.input_tokens + 5
    )
    assert (
        response.metadata == {"k": "v"} and response.instructions == "Be terse." and response.temperature == 0
    )


def test_a_reply_that_ends_is_completed(client, model):
    cut = create(client, model=model, input="Hi", max_output_tokens=3, temperature=0, extra_body=FORCED)
    # the same greedy reply, ended by a stop string it holds
    ended = create(client, model=model, input="Hi", temperature=0, extra_body={"stop": [cut.output_text[-1]]})
    assert ended.status == "completed" and ended.completed_at >= ended.created_at
    assert ended.incomplete_details is None and ended.output[0].status == "completed"
    assert cut.output_text.startswith(ended.output_text) and cut.output[0].status == "incomplete"
    # the SDK's stream helper, which rebuilds the response from the events
    stop = {"stop": [cut.output_text[-1]]}
    with client.responses.stream(model=model, input="Hi", temperature=0, extra_body=stop) as stream:
        final = stream.get_final_response()
    assert final.output_text == ended.output_text and final.status == "completed"


def test_streamed_events_parse_and_add_up_to_the_response(client, model, server):
    fields = {"model": model, "input": "Tell me a story.", "max_output_tokens": 6, "temperature": 0}
    whole = create(client, **fields, extra_body=FORCED)
    stream = client.responses.create(**fields, stream=True, extra_body=FORCED)
    events = [strictly(ResponseStreamEvent, event.to_dict()) for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == events[-4].text == final.output_text == whole.output_text  # greedy: the same text
    assert final.usage == whole.usage and final.id == events[0].response.id != whole.id
    kept = httpx.get(f"{server.url}/v1/responses/{final.id}").json()
    assert strictly(Response, kept) == final


def png_data_url() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (56, 84), (10, 120, 200)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def wav_base64() -> str:
    return base64.b64encode(SPEECH.read_bytes()).decode()


@pytest.mark.parametrize(
    ("part", "chat_part"),
    [
        (
            lambda: {"type": "input_image", "image_url": png_data_url(), "detail": "auto"},
            lambda: {"type": "image_url", "image_url": {"url": png_data_url()}},
        ),
        (
            lambda: {"type": "input_audio", "input_audio": {"data": wav_base64(), "format": "wav"}},
            lambda: {"type": "input_audio", "input_audio": {"data": wav_base64(), "format": "wav"}},
        ),
    ],
    ids=["image", "audio"],
)
def test_media_in_the_input_is_laid_out_as_chats(client, model, part, chat_part):
    text = {"type": "input_text", "text": "What is this?"}
    seen = create(
        client, model=model, input=[{"role": "user", "content": [part(), text]}], max_output_tokens=1
    )
    chat = [{"role": "user", "content": [chat_part(), {"type": "text", "text": "What is this?"}]}]
    same = client.chat.completions.create(model=model, messages=chat, max_tokens=1)
    assert seen.usage.input_tokens == same.usage.prompt_tokens  # placeholders and all
    alone = create(client, model=model, input=[{"role": "user", "content": [text]}], max_output_tokens=1)
    assert seen.usage.input_tokens > alone.usage.input_tokens


def test_previous_response_id_continues_the_conversation(client, model, processor):
    first = create(client, model=model, input="Hello.", max_output_tokens=4, temperature=0, extra_body=FORCED)
    second = create(
        client, model=model, input="And then?", previous_response_id=first.id, instructions="Be kind.",
        max_output_tokens=4, temperature=0, extra_body=FORCED,
    )  # fmt: skip
    conversation = [
        {"role": "system", "content": "Be kind."},  # this request's instructions; the first had none
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == prompt_tokens(processor, conversation)
    third = create(client, model=model, input="Go on.", previous_response_id=second.id, max_output_tokens=1)
    later = [*conversation[1:], {"role": "assistant", "content": second.output_text}]
    assert third.usage.input_tokens == prompt_tokens(
        processor, [*later, {"role": "user", "content": "Go on."}]
    )


def test_output_items_sent_back_as_input_continue_the_conversation(client, model):
    """The Agents SDK's way: the whole history each turn, the earlier output items as they came."""
    first = create(client, model=model, input="Hello.", max_output_tokens=3, extra_body=FORCED)
    by_id = create(client, model=model, input="More.", previous_response_id=first.id, max_output_tokens=1)
    history = [
        {"role": "user", "content": "Hello."},
        *(item.model_dump(exclude_none=True) for item in first.output),
        {"role": "user", "content": "More."},
    ]
    sent_back = create(client, model=model, input=history, max_output_tokens=1)
    assert sent_back.usage.input_tokens == by_id.usage.input_tokens


def test_kept_responses_are_read_deleted_and_bounded(client, model, server):
    kept = create(client, model=model, input="Hi", max_output_tokens=1)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.BadRequestError) as gone:
        client.responses.create(model=model, input="Hi", previous_response_id=kept.id)
    assert gone.value.body["param"] == "previous_response_id" and kept.id in gone.value.body["message"]
    unstored = create(client, model=model, input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    oldest, *newer = [create(client, model=model, input="Hi", max_output_tokens=1) for _ in range(4)]
    with pytest.raises(openai.NotFoundError):  # the server keeps 3: the oldest went
        client.responses.retrieve(oldest.id)
    assert [client.responses.retrieve(r.id).id for r in newer] == [r.id for r in newer]
    assert httpx.delete(f"{server.url}/v1/responses/resp_unknown").status_code == 404


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"surprise": 1}, "surprise", "unknown field"),
        ({"max_output_tokens": 0}, "max_output_tokens", ""),
        ({"temperature": -1}, "temperature", ""),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", "function_call_output"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0]",
            "input_file",
        ),  # fmt: skip
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0].file_id",
            "image_url",
        ),  # fmt: skip
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", ""),
        (
            {"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
            "input[0].content",
            "text only",
        ),  # fmt: skip
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only 'function'"),
        ({"include": ["message.output_text.logprobs"]}, "include", "logprobs"),
        ({"background": True}, "background", ""),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format", "name and its schema"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(server, model, fields, param, needle):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": model, "input": "Hi", **fields})
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "invalid_request_error", r.text
    assert error["param"] == param and needle in error["message"], error


def test_bad_media_is_named_by_its_input_item(server, model):
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    items = [{"role": "user", "content": "Hi"}, {"role": "user", "content": [image]}]
    body = {"model": model, "input": items, "instructions": "Be terse."}
    r = httpx.post(f"{server.url}/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("input[1].content[0]: "), r.text


def test_the_fields_accepted_and_ignored(client, model):
    response = create(
        client, model=model, input="Hi", max_output_tokens=1, user="u", truncation="auto", store=True,
        reasoning={"effort": "low"}, parallel_tool_calls=False, tool_choice="none", top_logprobs=0,
        include=["reasoning.encrypted_content"], text={"format": {"type": "text"}, "verbosity": "low"},
        prompt_cache_key="k", safety_identifier="s", service_tier="auto",
    )  # fmt: skip
    assert response.truncation == "auto" and response.parallel_tool_calls is False
    assert response.tool_choice == "none" and response.user == "u"


def test_a_streamed_body_is_server_sent_events_with_their_names(server, model):
    body = {"model": model, "input": "Hi", "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=60) as r:
        blocks = r.read().decode().removesuffix("\n\n").split("\n\n")
    names = []
    for block in blocks:  # no `data: [DONE]`: OpenAI's stream ends with its last event
        name, data = block.split("\n")
        names.append(name.removeprefix("event: "))
        assert names[-1] == json.loads(data.removeprefix("data: "))["type"]
    assert names[0] == "response.created" and names[-1] == "response.incomplete"
