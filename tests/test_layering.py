"""The import rules of omnistage's layers (ARCHITECTURE.md, "The request path"), checked on the source.

Every `omnistage` import of every module under omnistage/ points down this stack, or stays in its own layer:

    entry points   cli/, llm.py (the offline API), bench/, ray/ (replicas on Ray Serve), the package's own
                   __init__
    server         server/, and media.py (the media parts of a request fetched and decoded, at the edge)
    pipeline       pipeline/
    engine         engine/
    engine's data  config/ (the YAML topology the engine is built from), request.py (what a request asks
                   for: the sampling and speech parameters, the request built at the edge), outputs.py (what
                   it returns)
    models         models/<family>/, models/loader.py and the modules the families share beside it
    layers         models/layers/ (no other models package)
    kernels        kernels/ (every Triton kernel and its launcher; nothing above it)
    errors         errors.py (every layer raises them)

So models never import the engine, the pipeline or the server (nor the serving config), the engine never
imports the pipeline or the server, the pipeline never the server, and models/layers no family. Nor does the
engine import a family (models/qwen3_omni, models/qwen3_asr): what it needs of a model is a protocol of its own
(engine/stages/decoder.py), and a family's pipeline module hands its classes in. An import
inside a function or under TYPE_CHECKING is a dependency all the same, and so is `import_module("omnistage.…")`.
A new top-level module or package fails `test_every_module_has_a_layer` until it is placed in LAYERS.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "omnistage"

# Each part of the package and its height in the stack: a module may import a part at its height or below.
LAYERS = {
    "errors": 0,
    "kernels": 1,
    "models.layers": 2,
    "models": 3,  # the families (models/qwen3_omni, models/qwen3_asr), models/*.py, models/__init__.py
    "config": 4,
    "outputs": 4,
    "request": 4,
    "engine": 5,
    "pipeline": 6,
    "server": 7,
    "media": 7,
    "cli": 8,
    "llm": 8,
    "bench": 8,
    "ray": 8,
    "omnistage": 8,  # the package's __init__: its lazy public names (LLM, SamplingParams, RequestOutput)
}

# Imports that break a rule today, each with why it stays for now: (importing module, imported module).
# An entry no import needs any longer fails `test_no_stale_exceptions`.
EXCEPTIONS: dict[tuple[str, str], str] = {}

# The model families: the packages under omnistage/models/ but its layers.
FAMILIES = sorted(
    p.name for p in (PACKAGE / "models").iterdir() if (p / "__init__.py").exists() and p.name != "layers"
)


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    """`omnistage.models.layers.moe` -> "models.layers"; `omnistage.engine.attention.cuda` -> "engine"."""
    parts = module.split(".")
    if len(parts) == 1:
        return "omnistage"
    if parts[1] == "models":
        return "models.layers" if len(parts) > 2 and parts[2] == "layers" else "models"
    return parts[1]


def omnistage_imports(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The omnistage modules `source` (of `module`) imports anywhere in it: top level, functions,
    TYPE_CHECKING blocks, relative imports, and literal `import_module("omnistage...")` calls. `from pkg import
    name` counts as `pkg.name` where that is a module in `known`."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return {name for name in found if name == "omnistage" or name.startswith("omnistage.")}


def violations(module: str, imported: set[str]) -> list[str]:
    """The imports of `module` that point up the stack, or from models/layers into another models package."""
    own = layer_of(module)
    bad = []
    for target in sorted(imported):
        theirs = layer_of(target)
        if theirs not in LAYERS or own not in LAYERS:
            continue  # test_every_module_has_a_layer names it
        if LAYERS[theirs] > LAYERS[own]:
            bad.append(f"{module} imports {target} ({own} may not import {theirs})")
    return bad


def _modules() -> dict[str, tuple[Path, str]]:
    return {module_name(path): (path, path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _all_imports() -> dict[str, set[str]]:
    known = set(MODULES)
    return {
        module: omnistage_imports(source, module, path.name == "__init__.py", known)
        for module, (path, source) in MODULES.items()
    }


IMPORTS = _all_imports()


def test_every_module_has_a_layer():
    unplaced = sorted({layer_of(m) for m in MODULES} - set(LAYERS))
    assert not unplaced, f"place these parts of omnistage in LAYERS (tests/test_layering.py): {unplaced}"


def test_imports_point_down_the_stack():
    found = []
    for module, imported in IMPORTS.items():
        for target in sorted(imported):
            if (module, target) not in EXCEPTIONS:
                found += violations(module, {target})
    assert not found, "imports against the layering (ARCHITECTURE.md):\n" + "\n".join(found)


def family_of(module: str) -> str | None:
    """`omnistage.models.qwen3_omni.thinker` -> "qwen3_omni"; None for a module of no family."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "models" and parts[2] in FAMILIES else None


def test_the_engine_names_no_family():
    found = [
        f"{module} imports {target}"
        for module, imported in IMPORTS.items()
        if layer_of(module) == "engine"
        for target in sorted(imported)
        if family_of(target) is not None and (module, target) not in EXCEPTIONS
    ]
    assert not found, "the engine imports a model family (engine/stages/decoder.py):\n" + "\n".join(found)


def test_the_family_scan_sees_the_families():
    assert FAMILIES == ["qwen3_asr", "qwen3_omni"]
    assert family_of("omnistage.models.qwen3_asr.decoder") == "qwen3_asr"
    assert family_of("omnistage.models.layers.moe") is None and family_of("omnistage.models.loader") is None


def test_no_stale_exceptions():
    stale = [pair for pair in EXCEPTIONS if pair[1] not in IMPORTS.get(pair[0], set())]
    assert not stale, f"EXCEPTIONS no import needs any longer: {stale}"


def test_the_scan_sees_known_imports():
    """The scan itself reads the tree: a few imports that exist today, of each kind it must see."""
    assert "omnistage.errors" in IMPORTS["omnistage.config.loading"]  # top level
    assert "omnistage.llm" in IMPORTS["omnistage"]  # under TYPE_CHECKING, and by import_module
    assert any(layer_of(t) == "models.layers" for t in IMPORTS["omnistage.engine.stages.text"])


SYNTHETIC = [  # (module, is_package, source, the layers it wrongly reaches, or () where it is allowed)
    ("omnistage.engine.fake", False, "from omnistage.server.app import build_app\n", ["server"]),
    ("omnistage.engine.fake", False, "import omnistage.pipeline.family\n", ["pipeline"]),
    ("omnistage.engine.fake", False, "from ..pipeline import family\n", ["pipeline"]),
    ("omnistage.engine.stages", True, "from ... import server\n", ["server"]),
    ("omnistage.engine.fake", False, "from omnistage import media\n", ["media"]),
    (
        "omnistage.models.qwen3_omni.fake",
        False,
        "def load():\n    from omnistage.engine.sampling import SamplingParams\n",
        ["engine"],
    ),
    (
        "omnistage.models.layers.fake",
        False,
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from omnistage.models.qwen3_omni.config import TextConfig\n",
        ["models"],
    ),
    ("omnistage.models.qwen3_asr.fake", False, "from omnistage.config import EngineConfig\n", ["config"]),
    (
        "omnistage.pipeline.fake",
        False,
        "import importlib\nimportlib.import_module('omnistage.server.app')\n",
        ["server"],
    ),
    ("omnistage.server.fake", False, "from omnistage.engine.sampling import SamplingParams\n", []),
    (
        "omnistage.engine.fake",
        False,
        "from omnistage.models.layers import moe\nfrom . import scheduler\n",
        [],
    ),
    ("omnistage.models.qwen3_asr.fake", False, "from omnistage.models.qwen3_omni import config\n", []),
    ("omnistage.pipeline.fake", False, "import torch\nfrom omnistage.errors import ConfigError\n", []),
]


@pytest.mark.parametrize(
    ("module", "is_package", "source", "reaches"),
    SYNTHETIC,
    ids=[
        f"{m.removeprefix('omnistage.')}-{'refused' if r else 'allowed'}-{i}"
        for i, (m, _, _, r) in enumerate(SYNTHETIC)
    ],
)
def test_a_forbidden_import_fails(module, is_package, source, reaches):
    imported = omnistage_imports(source, module, is_package, set(MODULES))
    found = violations(module, imported)
    assert [layer_of(t) for t in sorted(imported) if violations(module, {t})] == reaches, found
