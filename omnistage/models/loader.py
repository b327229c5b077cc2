"""Loading safetensors checkpoints into our modules by the released file names.

Parameter names of our modules equal the checkpoint's names minus a prefix (`thinker.`, ...), so loading
is a lookup. The one exception is MoE experts: the files hold one tensor per expert
(`...mlp.experts.7.gate_proj.weight`) and we keep them stacked for grouped GEMMs (`...mlp.experts.w13`
[E, 2I, H], gate rows then up rows, and `...mlp.experts.w2` [E, H, I]).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from omnistage.errors import CheckpointError
from omnistage.models.layers.linear import fuse_projections

M = TypeVar("M", bound=torch.nn.Module)

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_EXPERT = re.compile(r"^(?P<moe>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
_PROGRESS_BYTES = 2 << 30  # a bar only where loading takes long enough to watch
_LISTED = 8


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" (+{len(names) - _LISTED} more)" if len(names) > _LISTED else "")


def checkpoint_files(directory: str | Path) -> dict[str, Path]:
    """Every tensor name of a checkpoint directory mapped to the safetensors file that holds it."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: unreadable index ({exc})") from None
        files = {name: directory / shard for name, shard in weight_map.items()}
        missing = sorted({path.name for path in files.values() if not path.exists()})
        if missing:
            raise CheckpointError(f"{index}: shard file(s) missing: {', '.join(missing)}")
        return files
    single = directory / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}")
    with _open(single) as f:
        return {name: single for name in f.keys()}


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None


def _targets(module: torch.nn.Module, prefix: str, names: list[str]) -> dict[str, tuple[str, tuple]]:
    """File name -> (parameter name, index into it) for every file tensor under `prefix`."""
    params = module.state_dict(keep_vars=True)
    targets: dict[str, tuple[str, tuple]] = {}
    for name in names:
        local = name[len(prefix) :]
        if local in params:
            targets[name] = (local, ())
            continue
        m = _EXPERT.match(local)
        if m and f"{m['moe']}.w13" in params and int(m["expert"]) < params[f"{m['moe']}.w13"].shape[0]:
            expert = int(m["expert"])
            if m["proj"] == "down":
                targets[name] = (f"{m['moe']}.w2", (expert,))
            else:
                half = params[f"{m['moe']}.w13"].shape[1] // 2
                rows = slice(0, half) if m["proj"] == "gate" else slice(half, 2 * half)
                targets[name] = (f"{m['moe']}.w13", (expert, rows))
    return targets


def _expected_file_names(module: torch.nn.Module, prefix: str) -> set[str]:
    names: set[str] = set()
    for local, param in module.state_dict(keep_vars=True).items():
        if local.endswith(".experts.w13") or local.endswith(".experts.w2"):
            moe = local.rsplit(".", 1)[0]
            projs = ("gate", "up") if local.endswith("w13") else ("down",)
            names.update(f"{prefix}{moe}.{e}.{p}_proj.weight" for e in range(param.shape[0]) for p in projs)
        else:
            names.add(prefix + local)
    return names


def load_weights(
    module: torch.nn.Module,
    directory: str | Path,
    prefix: str,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    exclude: tuple[str, ...] = (),
) -> None:
    """Fill `module` from the checkpoint tensors named `prefix + parameter name`, strictly.

    Every parameter and persistent buffer must be found and every file tensor under `prefix` must be
    used, except those under an `exclude` prefix (a nested component another module loads, such as
    `talker.code_predictor.`); shapes must match exactly. A module built on the meta device is
    materialised on `device` first; then each submodule with an `init_buffers()` method recomputes its
    derived buffers.
    `dtype` converts parameters only: derived buffers such as rotary frequencies keep their precision.
    """
    if any(p.is_meta for p in module.parameters()):
        _empty_on(module, device or "cpu", dtype)
        _init_buffers(module)
    else:
        if device is not None:
            module.to(device)
        if dtype is not None:
            for param in module.parameters():
                param.data = param.data.to(dtype)
    files = checkpoint_files(directory)
    names = sorted(n for n in files if n.startswith(prefix) and not n.startswith(exclude))
    targets = _targets(module, prefix, names)
    unexpected = [n for n in names if n not in targets]
    if unexpected:
        raise CheckpointError(
            f"{directory}: {len(unexpected)} tensor(s) under '{prefix}' that the model does not have: "
            f"{_listing(unexpected)}"
        )
    expected = _expected_file_names(module, prefix)
    missing = sorted(expected - set(names))
    if missing:
        raise CheckpointError(
            f"{directory}: {len(missing)} tensor(s) missing from the checkpoint: {_listing(missing)}"
        )
    state = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in _read(files, names):
            local, index = targets[name]
            dest = state[local][index] if index else state[local]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"{name}: expected shape {tuple(dest.shape)}, found {tuple(tensor.shape)} in {files[name].name}"
                )
            dest.copy_(tensor)


def _read(files: dict[str, Path], names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors in file order (memory-mapped, one shard open at a time), with a bar for large checkpoints."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    total = sum(path.stat().st_size for path in by_file)
    with tqdm(
        total=len(names), desc="Loading weights", unit="tensor", disable=total < _PROGRESS_BYTES
    ) as bar:
        for path, shard_names in by_file.items():
            with ExitStack() as stack:
                f = stack.enter_context(_open(path))
                for name in shard_names:
                    try:
                        tensor = f.get_tensor(name)
                    except (SafetensorError, OSError, ValueError) as exc:
                        raise CheckpointError(f"{path}: cannot read tensor {name} ({exc})") from None
                    yield name, tensor
                    bar.update()


@torch.no_grad()
def fill_random_(module: torch.nn.Module, seed: int = 0) -> None:
    """Random weights in place, on whatever device the module lives: for benchmarks without a checkpoint.

    Gains near 1, small biases, 1/sqrt(fan_in) matrices keep activations O(1) at any depth.
    """
    generator = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for name, param in module.named_parameters():
        if param.dim() == 1:
            base = 1.0 if name.endswith("weight") else 0.0
            param.normal_(generator=generator).mul_(0.1).add_(base)
        else:
            fan_in = param.shape[-1] if param.dim() == 2 or name.endswith(("w13", "w2")) else param[0].numel()
            param.normal_(generator=generator).mul_(fan_in**-0.5)


def _init_buffers(module: torch.nn.Module) -> None:
    """Recompute the derived buffers of each submodule that has an `init_buffers()` method."""
    for sub in module.modules():
        init_buffers = getattr(sub, "init_buffers", None)
        if init_buffers is not None:
            init_buffers()


def _empty_on(module: torch.nn.Module, device: torch.device | str, dtype: torch.dtype | None) -> None:
    """`module.to_empty(device=device)` with its floating parameters made in `dtype` (if given) at once: a
    float32 copy first needs twice the memory (the released Thinker's, ~127 GB, fits no 80 GB card). A
    parameter that two modules share stays shared."""
    made: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            if id(param) not in made:
                kind = dtype if dtype is not None and param.is_floating_point() else param.dtype
                empty = torch.empty_like(param, device=device, dtype=kind)
                made[id(param)] = torch.nn.Parameter(empty, requires_grad=param.requires_grad)
            setattr(sub, name, made[id(param)])
        for name, buffer in list(sub.named_buffers(recurse=False)):
            setattr(sub, name, torch.empty_like(buffer, device=device))


@dataclass(frozen=True)
class LoadOptions:
    """How every component is loaded: its `dtype` and `device`, and the checkpoint's weights
    (`load_format="safetensors"`) or random ones from `seed` (`"dummy"`: only config.json is read, for
    benchmarks at the released sizes)."""

    dtype: torch.dtype
    device: torch.device | str
    load_format: str = "safetensors"
    seed: int = 0


def load_model(
    build: Callable[[], M],
    directory: str | Path,
    parts: str | Callable[[M], Iterable[tuple[torch.nn.Module, str]]],
    options: LoadOptions,
    *,
    exclude: tuple[str, ...] = (),
) -> M:
    """`build()` on the meta device with the checkpoint's weights, or random ones (`load_format="dummy"`), in
    eval mode, its projections fused (`linear.fuse_projections`).

    `parts`: the prefix of all the model's tensors, or the model's (module, prefix) pairs where its parts sit
    under different prefixes; `exclude`: file tensors under these prefixes belong to another module (see
    `load_weights`).
    """
    with torch.device("meta"):
        model = build()
    dtype, device = options.dtype, options.device
    for module, prefix in [(model, parts)] if isinstance(parts, str) else parts(model):
        if options.load_format == "dummy":
            _empty_on(module, device, dtype)
            _init_buffers(module)
            fill_random_(module, options.seed)
        else:
            load_weights(module, directory, prefix, dtype=dtype, device=device, exclude=exclude)
    model.requires_grad_(False).eval()
    fuse_projections(model)
    return model
