"""An EngineConfig from keywords or from a YAML file with flags on top, each error naming its key."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml
from pydantic import ValidationError

from omnistage.config.engine import EngineConfig
from omnistage.config.flags import STAGE_KEYWORDS
from omnistage.config.sections import KV_KEYS, STAGES, SettingError
from omnistage.errors import ConfigError


def _describe(exc: ValidationError, source: str, prefix: str = "") -> str:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        reason = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        error = err.get("ctx", {}).get("error")
        if isinstance(error, SettingError):
            loc += [error.path] if error.path else []
            reason = error.reason
        path = ".".join(loc)
        lines.append(f"{source}: {prefix + path if path else '(top level)'}: {reason}")
    return "\n".join(lines)


def _build(mapping: dict, source: str, prefix: str = "") -> EngineConfig:
    try:
        return EngineConfig(**mapping)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source, prefix)) from None


def _section(mapping: dict, parents: list[str]) -> dict:
    """The mapping at `parents` below `mapping`, made where it is missing."""
    for key in parents:
        if not isinstance(mapping.get(key), dict):
            mapping[key] = {}
        mapping = mapping[key]
    return mapping


def _split(values: dict) -> tuple[dict, dict[str, object]]:
    """Keywords as schema keys (a copy, for placing into) and as schema paths below `stages:`."""
    keys = copy.deepcopy({k: v for k, v in values.items() if k not in STAGE_KEYWORDS})
    return keys, {STAGE_KEYWORDS[k]: v for k, v in values.items() if k in STAGE_KEYWORDS}


def engine_config(source: str = "arguments", **values) -> EngineConfig:
    """An EngineConfig from keywords: the flags' names (`max_num_seqs`, `num_kv_pages`, ...) and the schema's
    top-level keys (`stages`, `speech`, ...); raises ConfigError naming each bad key, or a setting given
    twice (a flag's keyword and its key under `stages`)."""
    mapping, paths = _split(values)
    for path, value in paths.items():
        *parents, last = path.split(".")
        section = _section(mapping, parents)
        if section.get(last) not in (None, value):
            name = next(k for k, p in STAGE_KEYWORDS.items() if p == path)
            raise ConfigError(
                f"{source}: {name}: {value!r}, but {path} is {section[last]!r}: they are one setting, give it once"
            )
        section[last] = value
    return _build(mapping, source)


def _replaced_by(path: str) -> list[str]:
    """The keys of a file (dotted paths below `engine:`) that a command-line value for `path` replaces: the
    keys of the same setting (`--device cpu` moves every stage)."""
    if path in ("device", "enforce_eager"):
        return [f"stages.{s}.{path}" for s in STAGES]
    *parents, last = path.split(".")
    if last in KV_KEYS:
        return [".".join([*parents, key]) for key in KV_KEYS]
    if last == "max" and parents[-1].endswith("graphs"):
        return [".".join(parents)]  # the file's buckets too
    return [path]


def load_config(path: str | Path, **overrides) -> EngineConfig:
    """The YAML file's `engine:` section with CLI `overrides` (keywords as `engine_config` takes them; None
    values ignored) on top: a flag replaces the file's key and every key of the same setting."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    unknown = sorted(set(data) - {"engine"})
    if unknown:
        raise ConfigError(f"{path}: {unknown[0]}: unknown key (expected 'engine')")
    section = data.get("engine") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: engine: expected a mapping")
    _build(section, str(path), prefix="engine.")
    keys, paths = _split({k: v for k, v in overrides.items() if v is not None})
    merged = copy.deepcopy(section)
    for target, value in [*keys.items(), *paths.items()]:
        for replaced in _replaced_by(target):
            *parents, last = replaced.split(".")
            _section(merged, parents).pop(last, None)
        *parents, last = target.split(".")
        _section(merged, parents)[last] = value
    config = _build(merged, str(path))
    config._source = str(path)
    return config
