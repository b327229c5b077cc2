"""Engine settings: one strict pydantic schema for the YAML file, with the CLI and the offline `LLM` on top.

An unknown or mistyped key fails at start with its path and the reason. Each setting has one key: the
engine-wide ones at the top (`engine.py`), each stage's under `stages:` (`sections.py`), which is the
topology: where each stage (Thinker, encoders, Talker, code predictor, Code2Wav) runs, its KV pool, its batch
limit, its CUDA graph sizes and its workspaces. `EngineConfig.stage(name)` gives one stage's settings with
every default resolved (`settings.py`); `pipeline/topology.py` checks them against the machine at start. The
command line's flags and the `LLM` keywords are one table onto these keys (`flags.py`).
"""

from omnistage.config.engine import EngineConfig
from omnistage.config.loading import engine_config, load_config
from omnistage.config.sections import STAGE_TITLES, STAGES, StageName
from omnistage.config.settings import (
    DecoderSettings,
    EncodersSettings,
    EngineSettings,
    Graphs,
)

__all__ = [
    "STAGES",
    "STAGE_TITLES",
    "DecoderSettings",
    "EncodersSettings",
    "EngineConfig",
    "EngineSettings",
    "Graphs",
    "StageName",
    "engine_config",
    "load_config",
]
