"""Chat messages to token ids for Qwen3-Omni: the checkpoint's chat template and tokenizer."""

from __future__ import annotations

from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from omnistage.errors import CheckpointError, InvalidRequest

_ROLES = {"system", "user", "assistant"}


class Processor:
    """Renders chat messages with the checkpoint's template and encodes them with its tokenizer."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        directory = Path(checkpoint_dir)
        try:
            self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
            template = (directory / "chat_template.jinja").read_text()
        except Exception as exc:
            raise CheckpointError(f"{directory}: cannot read the tokenizer or chat template ({exc})") from None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(template)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not messages:
            raise InvalidRequest("messages: at least one message is required")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in _ROLES:
                raise InvalidRequest(f"messages[{i}].role: must be one of {sorted(_ROLES)}")
            content = message.get("content")
            if content is None:
                raise InvalidRequest(f"messages[{i}].content: missing")
            if not isinstance(content, str | list):
                raise InvalidRequest(f"messages[{i}].content: must be a string or a list of content parts")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
