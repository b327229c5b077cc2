"""The engine's flags, derived from the settings schema: `config.flags` names them, the fields say the rest."""

from __future__ import annotations

import argparse
import typing

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from omnistage.config import EngineConfig, engine_config, load_config
from omnistage.config.flags import FLAGS, MAPPINGS, SWITCHES, keyword


def engine_config_of(args: argparse.Namespace) -> EngineConfig:
    """--config's `engine:` section with the engine flags on top (a flag not given is None: the file's value,
    else the schema's default, stands)."""
    overrides = {keyword(flag): getattr(args, keyword(flag)) for flag in FLAGS}
    overrides |= {key: getattr(args, key) for key, _ in SWITCHES.values()}
    overrides |= {
        key: dict(getattr(args, key)) if getattr(args, key) else None for key, _ in MAPPINGS.values()
    }
    if args.config:
        return load_config(args.config, **overrides)
    return engine_config("command line", **{k: v for k, v in overrides.items() if v is not None})


def _shown(value: object) -> str:
    """A value as the YAML file writes it."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _fields(path: str) -> list[FieldInfo]:
    """The schema's fields along the dotted `path`, from the top-level one down."""
    model: type[BaseModel] | None = EngineConfig
    fields = []
    for key in path.split("."):
        assert model is not None, path
        field = model.model_fields[key]
        fields.append(field)
        kinds = (field.annotation, *typing.get_args(field.annotation))
        model = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
    return fields


def _help(fields: list[FieldInfo], path: str) -> str:
    """A flag's help: the field's description (a stage key's with its path and its sections'), and its
    default where the description does not say it."""
    if len(fields) == 1:
        text = fields[0].description or ""
    else:
        text = f"{path}: " + "; ".join(f.description for f in fields[1:] if f.description)
    default = fields[-1].default
    return text if default is None or "default" in text else f"{text} (default: {_shown(default)})"


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (`config.flags`), each with its schema field's help, type, choices and default."""
    for flag, path in FLAGS.items():
        fields = _fields(path)
        annotation = fields[-1].annotation
        kinds = [k for k in typing.get_args(annotation) or (annotation,) if k is not type(None)]
        literal = typing.get_origin(annotation) is typing.Literal
        parser.add_argument(
            flag,
            dest=keyword(flag),
            type=str if literal else kinds[0],
            default=None,  # not given: the YAML file's value, else the schema's default, stands
            choices=tuple(kinds) if literal else None,
            help=_help(fields, path),
        )
    for flag, (key, value) in SWITCHES.items():
        parser.add_argument(
            flag,
            dest=key,
            action="store_const",
            const=value,
            default=None,
            help=f"{key}: {_shown(value)}; {_help(_fields(key), key)}",
        )
    for flag, (key, value_name) in MAPPINGS.items():
        parser.add_argument(
            flag,
            dest=key,
            action="append",
            type=_entry,
            default=None,
            metavar=f"NAME={value_name}",
            help=f"{key}, one entry; repeatable: {_help(_fields(key), key)}",
        )


def _entry(text: str) -> tuple[str, str]:
    """`alloy=chelsie` -> ("alloy", "chelsie"): one entry of a mapping flag."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=VALUE")
    return name.strip(), value.strip()


def add_load_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a command that loads the checkpoint as serve would."""
    parser.add_argument("--config", help="YAML file with an `engine:` section; the flags below override it")
    add_engine_flags(parser)
