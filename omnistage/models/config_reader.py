"""Reading a checkpoint's `config.json` into typed dataclasses, naming the full key path in every error.

A config dataclass declares what it reads: each field is read from the key of its name, by its type (`Size`
for a positive int, `int`, `float`, `bool`, `str`, a tuple from a list, a dict); a field read another way (a
nested section, another key, a default) is given to `ConfigReader.read` by its reader.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_origin, get_type_hints

from omnistage.errors import ConfigError

T = TypeVar("T")

Size = Annotated[int, "positive"]
"""A count or a width: an int above zero."""


class ConfigReader:
    """Reads typed values out of one nested dict and names the full key path in every error."""

    def __init__(self, data: dict, path: str):
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected an object, found {type(data).__name__}")
        self.data, self.path = data, path

    @classmethod
    def of_model(cls, data: dict, model_type: str) -> ConfigReader:
        """A reader of a whole config.json, which must be of `model_type`."""
        r = cls(data, "")
        found = r.get("model_type", str)
        if found != model_type:
            raise ConfigError(f"model_type: omnistage serves {model_type!r} here, found {found!r}")
        return r

    def child(self, key: str) -> ConfigReader:
        return ConfigReader(self.get(key, dict), f"{self.path}.{key}" if self.path else key)

    def get(self, key: str, kind: type, default: Any = ...) -> Any:
        where = f"{self.path}.{key}" if self.path else key
        if key not in self.data or self.data[key] is None:
            if default is ...:
                raise ConfigError(f"{where}: missing")
            return default
        value = self.data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(f"{where}: expected {kind.__name__}, found {value!r}")
        return value

    def positive(self, key: str) -> int:
        value = self.get(key, int)
        if value <= 0:
            raise ConfigError(f"{self.path}.{key}: must be positive, found {value}")
        return value

    def fail(self, key: str, reason: str) -> ConfigError:
        return ConfigError(f"{self.path}.{key}: {reason}")

    def read(self, cls: type[T], **given: Any) -> T:
        """The dataclass `cls` with the `given` fields, and every other field read from the key of its name."""
        hints = get_type_hints(cls, include_extras=True)
        values = {}
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            values[field.name] = (
                given[field.name] if field.name in given else self._value(field.name, hints[field.name])
            )
        return cls(**values)

    def _value(self, key: str, kind: Any) -> Any:
        if kind == Size:
            return self.positive(key)
        if get_origin(kind) is tuple:
            return tuple(self.get(key, list))
        if get_origin(kind) is dict:
            return dict(self.get(key, dict))
        return self.get(key, kind)


@dataclass(frozen=True)
class DecoderConfig:
    """The sizes every Qwen3 decoder's config holds (the Thinker's, the Talker's, the code predictor's,
    Qwen3-ASR's); each family's config adds its MLP's and its rotary layout's."""

    vocab_size: Size
    hidden_size: Size
    num_hidden_layers: Size
    num_attention_heads: Size
    num_key_value_heads: Size
    head_dim: Size
    rms_norm_eps: float
    rope_theta: float

    def check_heads(self, r: ConfigReader) -> None:
        """GQA: the KV heads divide the query heads."""
        if self.num_attention_heads % self.num_key_value_heads:
            raise r.fail(
                "num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads {self.num_attention_heads}",
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in bf16."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2


def read_config_json(directory: str | Path) -> dict:
    """A checkpoint directory's config.json, or a ConfigError saying what is missing or unreadable."""
    if not Path(directory).is_dir():
        raise ConfigError(f"{directory}: the checkpoint directory does not exist")
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json in the checkpoint directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None
