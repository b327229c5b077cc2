"""`/v1/responses`' request (OpenAI's Responses API): input items, function tools and `text.format`, each
translated into the chat request it stands for (chat.py answers it), with the fields of OpenAI's schema that
have no chat counterpart accepted, ignored or refused as chat's are."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from omnistage.server.errors import InvalidField
from omnistage.server.protocol.base import Int64, Open, SamplingExtras, Strict, empty, never, unless
from omnistage.server.protocol.chat import InputAudio

_LOGPROBS_INCLUDE = "message.output_text.logprobs"
LOGPROBS = "logprobs are not supported in the Responses API yet"
# The fields a chat request takes by the same name.
_CHAT_FIELDS = (
    "model temperature top_p stream parallel_tool_calls top_k min_p seed stop stop_token_ids "
    "presence_penalty frequency_penalty repetition_penalty min_tokens ignore_eos skip_special_tokens "
    "include_stop_str_in_output"
).split()


def _type_of(default: str | None) -> Any:
    """A discriminator by the JSON object's `type` (`default` where it has none); the tags hold "[" so that
    error paths leave them out, as they read `input[0].content[1].text`."""

    def kind(value: Any) -> str | None:
        given = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        return f"[{given}]" if isinstance(given, str) else None

    return kind


class InputText(Open):
    type: Literal["input_text"]
    text: str

    def chat_part(self) -> dict[str, Any]:
        return {"type": "text", "text": self.text}


class InputImage(Open):
    """An image by URL: a data: URL always, http(s) or a file as the server's media policy allows."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: Annotated[str | None, unless(never, "files by id are not supported: give image_url")] = None
    detail: str | None = None  # accepted; images are sized by the processor's rules

    @model_validator(mode="after")
    def _has_url(self) -> InputImage:
        if self.image_url is None:
            raise ValueError("image_url is required (a data: URL, or what the server's media policy allows)")
        return self

    def chat_part(self) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": self.image_url}}


class InputAudioPart(Open):
    type: Literal["input_audio"]
    input_audio: InputAudio

    def chat_part(self) -> dict[str, Any]:
        return {"type": "input_audio", "input_audio": self.input_audio.model_dump()}


class OutputText(Open):
    """An earlier answer's text, as the SDK sends a response's output back as input."""

    type: Literal["output_text"]
    text: str

    def chat_part(self) -> dict[str, Any]:
        return {"type": "text", "text": self.text}


class Refusal(Open):
    type: Literal["refusal"]
    refusal: str

    def chat_part(self) -> dict[str, Any]:
        return {"type": "text", "text": self.refusal}


ContentPart = Annotated[
    Annotated[InputText, Tag("[input_text]")]
    | Annotated[InputImage, Tag("[input_image]")]
    | Annotated[InputAudioPart, Tag("[input_audio]")]
    | Annotated[OutputText, Tag("[output_text]")]
    | Annotated[Refusal, Tag("[refusal]")],
    Discriminator(
        _type_of(None),
        custom_error_type="content_part_type",
        custom_error_message="content parts of type input_text, input_image, input_audio, output_text and "
        "refusal are supported (input_file is not)",
    ),
]


class Message(Open):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]

    def chat_message(self, path: str) -> dict[str, Any]:
        """The chat's message; an assistant's parts are its text (`path`: the item's field, for a refusal)."""
        if isinstance(self.content, str):
            return {"role": self.role, "content": self.content}
        parts = [part.chat_part() for part in self.content]
        if self.role != "assistant":
            return {"role": self.role, "content": parts}
        if any(part["type"] != "text" for part in parts):
            raise InvalidField(f"{path}.content", "an assistant message holds text only")
        return {"role": self.role, "content": "".join(part["text"] for part in parts)}


class FunctionCall(Open):
    """A call the model made earlier (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str

    def chat_tool_call(self) -> dict[str, Any]:
        return {
            "id": self.call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class FunctionCallOutput(Open):
    """What a call returned: the chat's tool message."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    def chat_message(self, path: str) -> dict[str, Any]:
        output = self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)
        return {"role": "tool", "tool_call_id": self.call_id, "content": output}


InputItem = Annotated[
    Annotated[Message, Tag("[message]")]
    | Annotated[FunctionCall, Tag("[function_call]")]
    | Annotated[FunctionCallOutput, Tag("[function_call_output]")],
    Discriminator(
        _type_of("message"),
        custom_error_type="input_item_type",
        custom_error_message="input items of type message, function_call and function_call_output are "
        "supported",
    ),
]


class FunctionTool(Open):
    type: str
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"tools of type {value!r} are not supported; only 'function' tools are")
        return value

    def chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(include={"name", "description", "parameters", "strict"}, exclude_none=True)
        return {"type": "function", "function": function}


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    """`text.format`: plain text, any JSON object, or JSON matching a schema (chat's `response_format`)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_named(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError("a json_schema format needs its name and its schema")
        return self

    def response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        given: dict[str, Any] = {"name": self.name, "schema": self.json_schema}
        given |= {"description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in given.items() if v is not None}}


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint these models do not take: ignored


class ResponsesStreamOptions(Strict):
    include_obfuscation: bool | None = None  # no padding is sent either way


class ResponsesRequest(SamplingExtras):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # kept for previous_response_id and GET unless false
    metadata: dict[str, str] | None = None  # echoed in the response
    text: TextConfig | None = None
    # The model's reasoning follows the checkpoint (a Thinking one reasons), not the effort asked for.
    reasoning: dict[str, Any] | None = None
    # "auto" drops no earlier turns: a conversation past the context is a 400, as with "disabled".
    truncation: Literal["auto", "disabled"] | None = None
    include: Annotated[
        list[str] | None,
        unless(lambda values: _LOGPROBS_INCLUDE not in values, f"{_LOGPROBS_INCLUDE}: " + LOGPROBS),
    ] = None  # the others ask for outputs of OpenAI's hosted tools or its encrypted reasoning: none here
    top_logprobs: Annotated[Int64 | None, unless(empty, LOGPROBS)] = None
    background: Annotated[bool | None, unless(empty, "background responses are not supported")] = None
    conversation: Annotated[
        str | dict[str, Any] | None,
        unless(never, "conversations are not supported; continue one with previous_response_id"),
    ] = None
    prompt: Annotated[dict[str, Any] | None, unless(never, "stored prompt templates are not supported")] = (
        None
    )
    context_management: Annotated[
        list[dict[str, Any]] | None, unless(empty, "context management (compaction) is not supported")
    ] = None
    moderation: Annotated[dict[str, Any] | None, unless(never, "moderation is not supported")] = None

    # Accepted and ignored: nothing the client gets from this server depends on them.
    user: str | None = None
    max_tool_calls: Int64 | None = None  # bounds OpenAI's hosted tools; function calls are the client's
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    image: dict[str, Any] | None = None

    def items(self) -> list[Message | FunctionCall | FunctionCallOutput]:
        if isinstance(self.input, str):
            return [Message(role="user", content=self.input)]
        return list(self.input)

    def chat_messages(self) -> list[tuple[str, dict[str, Any]]]:
        """The input as chat messages, each with the field it comes from: function calls in a row are one
        assistant message (with the text of an assistant message just before them)."""
        found: list[tuple[str, dict[str, Any]]] = []
        for i, item in enumerate(self.items()):
            path = f"input[{i}]" if isinstance(self.input, list) else "input"
            if isinstance(item, FunctionCall):
                last = found[-1][1] if found else None
                if last is not None and last["role"] == "assistant" and isinstance(last["content"], str):
                    last.setdefault("tool_calls", []).append(item.chat_tool_call())
                    continue
                found.append(
                    (path, {"role": "assistant", "content": "", "tool_calls": [item.chat_tool_call()]})
                )
            else:
                found.append((path, item.chat_message(path)))
        return found

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's fields beside its messages, by the chat's names."""
        fields: dict[str, Any] = {name: getattr(self, name) for name in _CHAT_FIELDS}
        fields["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            fields["tools"] = [tool.chat_tool() for tool in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        else:
            fields["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            fields["response_format"] = self.text.format.response_format()
        return {name: value for name, value in fields.items() if value is not None}
