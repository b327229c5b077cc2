"""How an in-process engine is sized when transformers runs beside it on the same device (`--baseline`)."""

from __future__ import annotations

# Our KV pool beside transformers on a GPU, as benchmarks/thinker_decode.py leaves it.
BASELINE_KV_GIB = 16.0


def kv_beside_baseline(given: float | None, baseline: bool, device: str | None) -> float | None:
    """The KV memory (GiB) of an in-process engine: what was given, else beside transformers on a GPU a fixed
    pool (ours would take all the memory left, and transformers needs some), else the engine's own default
    (the CPU's is small: a pool of BASELINE_KV_GIB there would take the host's memory)."""
    from omnistage.engine.devices import resolve_device

    if given or not baseline:
        return given
    return BASELINE_KV_GIB if resolve_device(device or "auto").type == "cuda" else None
