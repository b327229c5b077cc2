"""The command line's names for settings: one table from flag to schema path.

A flag keeps vLLM's name where vLLM has one (`--max-num-seqs` sets `stages.thinker.max_batch`); its help,
type, choices and default are the schema field's (`cli/engine_flags.py` reads them). The offline `LLM(...)` and
`engine_config(...)` take the same names as keywords (the flag without its dashes, `-` as `_`); a keyword
that is no flag's is a top-level key of the schema (`stages`, `speech`, `compile`, ...).
"""

from __future__ import annotations

# flag: the schema path it sets
FLAGS: dict[str, str] = {
    "--model": "model",
    "--load-format": "load_format",
    "--device": "device",
    "--dtype": "dtype",
    "--page-size": "page_size",
    "--num-kv-pages": "stages.thinker.num_kv_pages",
    "--kv-cache-memory-gib": "stages.thinker.kv_cache_memory_gib",
    "--gpu-memory-limit-gib": "gpu_memory_limit_gib",
    "--max-num-seqs": "stages.thinker.max_batch",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--max-model-len": "max_model_len",
    "--max-num-speaking": "max_num_speaking",
    "--max-graph-batch": "stages.thinker.graphs.max",
    "--max-prefill-graph-tokens": "stages.thinker.prefill_graphs.max",
    "--max-audio-graph-windows": "stages.encoders.audio_graphs.max",
    "--talker-max-num-batched-tokens": "stages.talker.max_num_batched_tokens",
    "--moe-kernel": "moe_kernel",
    "--long-prefill-kernel": "long_prefill_kernel",
    "--seed": "seed",
    "--admission-window-ms": "admission_window_ms",
    "--admission-hold-steps": "admission_hold_steps",
    "--stream-interval": "stream_interval",
    "--max-tokens-default": "max_tokens_default",
    "--encoder-cache-mib": "stages.encoders.cache_mib",
    "--encoder-rows-mib": "stages.encoders.rows_mib",
}

# on/off flag: (the schema's boolean key, the value the flag sets); as a keyword, the key itself
SWITCHES: dict[str, tuple[str, bool]] = {
    "--enforce-eager": ("enforce_eager", True),
    "--no-compile": ("compile", False),
    "--overlap-stages": ("overlap_stages", True),
    "--no-decode-ahead": ("decode_ahead", False),
    "--no-prefix-caching": ("prefix_caching", False),
    "--no-flash-prefill": ("flash_prefill", False),
}

# repeatable flag NAME=VALUE: (the schema's mapping it adds one entry to, what the entry's value is); a later
# one of the same NAME wins, and the flags together replace the YAML file's mapping
MAPPINGS: dict[str, tuple[str, str]] = {
    "--voice-alias": ("voice_aliases", "SPEAKER"),
}

# a key of the first schema, before the `stages:` section held it: where it lives now
MOVED: dict[str, str] = {
    "num_kv_pages": "stages.thinker.num_kv_pages",
    "kv_cache_memory_gib": "stages.thinker.kv_cache_memory_gib",
    "max_num_seqs": "stages.thinker.max_batch",
    "max_graph_batch": "stages.thinker.graphs.max",
    "max_prefill_graph_tokens": "stages.thinker.prefill_graphs.max",
    "talker_kv_cache_memory_gib": "stages.talker.kv_cache_memory_gib",
    "code2wav_max_batch": "stages.code2wav.max_streams",
    "speech_device": "stages.talker.device",
}


def keyword(flag: str) -> str:
    """`--max-num-seqs` -> `max_num_seqs`: the flag's name as a keyword and as its argparse dest."""
    return flag.removeprefix("--").replace("-", "_")


# keyword: the path below `stages:` it sets (the other flags' keywords are top-level keys already)
STAGE_KEYWORDS: dict[str, str] = {
    keyword(flag): path for flag, path in FLAGS.items() if path.startswith("stages.")
}


def flag_of(path: str) -> str | None:
    """The flag that sets the schema `path`, if one does."""
    return next((flag for flag, target in FLAGS.items() if target == path), None)
