"""Structured outputs through a live `omnistage serve` (tiny checkpoint, random weights, CPU), as clients ask for
them: `response_format` json_schema and json_object with the openai SDK, its `parse` helper with a pydantic
model, and LangChain's `with_structured_output`. Random weights still produce JSON that validates: the grammar
ends each reply, so max_tokens is set far above what the bounded schemas need."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

MAX_TOKENS = 1000
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


class Pet(BaseModel):
    name: str = Field(max_length=10)
    kind: Literal["cat", "dog", "fish"]
    legs: int = Field(ge=0, le=8)


@pytest.fixture(scope="module")
def server(launch_server):
    with launch_server("structured", "--num-kv-pages", "256", "--max-model-len", "2048") as server:
        yield server


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_validates(client, model, seed):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    reply = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        response_format=response_format,  # type: ignore[arg-type]
        temperature=1.0,
        seed=seed,
        max_tokens=MAX_TOKENS,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_streamed_json_schema_output_validates(client, model):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    stream = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        response_format=response_format,  # type: ignore[arg-type]
        seed=7,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_sdk_parse_with_a_pydantic_model(client, model):
    reply = client.chat.completions.parse(
        model=model, messages=MESSAGES, response_format=Pet, seed=3, max_tokens=MAX_TOKENS
    )
    pet = reply.choices[0].message.parsed
    assert isinstance(pet, Pet)
    assert reply.choices[0].finish_reason == "stop"


def test_langchain_with_structured_output(server, model):
    llm = ChatOpenAI(
        model=model, base_url=f"{server.url}/v1", api_key="none", max_retries=0, max_tokens=MAX_TOKENS, seed=5
    )
    pet = llm.with_structured_output(Pet, method="json_schema").invoke("Describe a pet.")
    assert isinstance(pet, Pet)


def test_a_schema_the_grammar_library_refuses_is_a_400_naming_response_format(client, model, server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            response_format=bad,  # type: ignore[arg-type]
            max_tokens=8,
        )
    assert err.value.param == "response_format"
    server.wait_pages_free(timeout=10)
