"""Where each stage runs: the `stages:` section of a config checked against the machine at start.

A pipeline calls `validate_topology` before it loads anything, so a stage placed on a GPU the machine does
not have, stages that must share a device placed apart, CUDA graphs asked of a CPU stage, a fixed KV pool too
small for one request, or KV shares of one device that add up to more than all of it fail at once with the
YAML key and what to do.
"""

from __future__ import annotations

import typing
from collections.abc import Iterable, Mapping

from omnistage.config import STAGE_TITLES, STAGES, EngineConfig, StageName
from omnistage.errors import ConfigError


def validate_topology(
    config: EngineConfig,
    device_count: int,
    max_len: Mapping[str, int] | None = None,
    stages: Iterable[StageName] | None = None,
) -> dict[StageName, str]:
    """Check the placement against a machine with `device_count` GPUs and return each stage's device
    ("cpu" or "cuda:N"; "auto" and "cuda" are taken as cuda:0 when there is a GPU).

    `max_len` is the longest request each stage must hold, in tokens (default: the Thinker's max_model_len
    where the config gives one); `stages` are those the pipeline loads (default: all, or the Thinker and
    encoders when speech is off). Raises ConfigError naming the YAML key and what to do.
    """
    names = list(stages) if stages is not None else list(STAGES if config.speech else STAGES[:2])
    where = f"{config.source}: " if config.source else ""

    def fail(key: str, text: str) -> typing.NoReturn:
        raise ConfigError(f"{where}engine.{key}: {text}")

    placed: dict[StageName, str] = {}
    for name in names:
        device, key = config.device_of(name)
        if device == "auto":
            device = "cuda" if device_count else "cpu"
        if device.startswith("cuda"):
            index = int(device.partition(":")[2] or 0)
            if index >= device_count:
                have = {0: "no GPU", 1: "1 GPU (cuda:0)"}.get(
                    device_count, f"{device_count} GPUs (cuda:0 to cuda:{device_count - 1})"
                )
                fail(
                    key, f"{device}, but this machine has {have}: place the stage on a GPU it has, or on cpu"
                )
            device = f"cuda:{index}"
        placed[name] = device
    for follower, leader, why in (
        ("encoders", "thinker", "their rows go straight into the Thinker's prefill"),
        ("code_predictor", "talker", "it runs inside every Talker step"),
    ):
        if follower in placed and leader in placed and placed[follower] != placed[leader]:
            fail(
                config.device_of(follower)[1],
                f"{placed[follower]}, but the {STAGE_TITLES[leader]} is on {placed[leader]} and {why}: "
                f"put both on the same device",
            )
    shares: dict[str, float] = {}
    for name in names:
        stage = config.stage(name)
        section = getattr(config.stages, name)
        if placed[name] == "cpu" and not stage.enforce_eager:
            for field in ("graphs", "prefill_graphs", "audio_graphs", "vision_graphs"):
                given = getattr(section, field, None)
                if given is not None and given.top is not None:
                    fail(
                        f"stages.{name}.{field}",
                        "CUDA graphs need a GPU and this stage runs on the CPU: "
                        f"remove the key or set stages.{name}.enforce_eager: true",
                    )
        kv = getattr(stage, "kv", None)
        if kv is None:
            continue
        longest = (max_len or {}).get(name, config.max_model_len if name == "thinker" else None)
        if kv.pages is not None and longest is not None and kv.pages * config.page_size < longest:
            need = -(-longest // config.page_size)
            fail(
                f"stages.{name}.num_kv_pages",
                f"{kv.pages:,} pages of {config.page_size} tokens hold {kv.pages * config.page_size:,} tokens, "
                f"less than one request of {longest:,}: give at least {need:,} pages, or a shorter max_model_len",
            )
        if kv.share is not None:
            if placed[name] == "cpu":
                fail(
                    f"stages.{name}.kv_share",
                    "a share of the planned memory needs a GPU; on the CPU give num_kv_pages or kv_cache_memory_gib",
                )
            shares[placed[name]] = shares.get(placed[name], 0.0) + kv.share
            if shares[placed[name]] > 1 + 1e-9:
                fail(
                    f"stages.{name}.kv_share",
                    f"the KV shares of the stages on {placed[name]} add up to {shares[placed[name]]:g}, more than "
                    "all of it: lower them to a sum of at most 1",
                )
    return placed
