"""Builds while serving are logged with their time (compile_watch.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from omnistage.engine.compile_watch import builds_while_serving, starting_up, watch_compiles


def test_a_graph_compiled_after_serving_started_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    watch = watch_compiles()
    before = len(watch.builds)

    @torch.compile(backend="eager")
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with caplog.at_level(logging.WARNING, logger="omnistage.engine.compile_watch"):
        assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
        double(torch.ones(3))  # compiled already: nothing new
    built = watch.builds[before:]
    assert len(built) == 1 and built[0][0].startswith("torch.compile graph")
    assert built[0][1] > 0
    assert "built while serving" in caplog.text and "torch.compile graph" in caplog.text


def test_a_triton_build_is_timed_from_its_start_hook_to_its_end_hook(
    caplog: pytest.LogCaptureFixture,
) -> None:
    triton = pytest.importorskip("triton")
    watch = watch_compiles()
    assert triton.knobs.runtime.jit_cache_hook == watch.triton_started
    before = len(watch.builds)
    # what Triton passes its hooks around a build (triton/runtime/jit.py, _call_hook)
    key = (("*bf16", "D"), ("i32", ""), "options")
    signature = {"x_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr"}
    hook = {
        "key": key,
        "repr": "_k[num_warps=4]",
        "fn": SimpleNamespace(name="_k"),
        "compile": {
            "signature": signature,
            "constants": {(2,): 64},
            "configs": [{(0,): [["tt.divisibility", 16]]}],
            "num_warps": 4,
            "num_stages": 3,
        },
    }
    with caplog.at_level(logging.WARNING, logger="omnistage.engine.compile_watch"):
        assert triton.knobs.runtime.jit_cache_hook(**hook) is None  # True would skip the build
        triton.knobs.runtime.jit_post_compile_hook(**hook)
    ((what, seconds),) = watch.builds[before:]
    assert what == "Triton kernel _k[num_warps=4, num_stages=3](BLOCK=64; 16-divisible or aligned: x_ptr)"
    assert 0 <= seconds < 1
    assert what in caplog.text
    assert watch_compiles() is watch  # installed once


def test_what_a_pipeline_builds_while_it_starts_is_not_counted_as_serving() -> None:
    watch = watch_compiles()
    before = len(builds_while_serving())

    @torch.compile(backend="eager")
    def triple(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    with starting_up():  # a second pipeline built in a process that already serves
        triple(torch.ones(2))
    assert len(builds_while_serving()) == before
    triple(torch.ones(2, 2, 2))  # a new rank: a new graph, now while serving
    assert len(builds_while_serving()) == before + 1
    assert watch.builds[-1][0].startswith("torch.compile graph")
