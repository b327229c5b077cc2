"""The Ray Serve deployment's settings from the serve flags, and every replica's /metrics merged into one."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("ray", reason="Ray Serve is the optional `ray` extra")

from omnistage.cli import build_parser  # noqa: E402
from omnistage.config import engine_config  # noqa: E402
from omnistage.errors import ConfigError  # noqa: E402
from omnistage.ray.launch import MAX_ONGOING_REQUESTS, Scaling, app_settings  # noqa: E402
from omnistage.ray.metrics import MetricsBoard, merged  # noqa: E402
from omnistage.ray.routing import SessionRouter  # noqa: E402


def scaling(*flags: str, device: str = "cpu") -> Scaling:
    args = build_parser().parse_args(["serve", "--ray", *flags])
    return Scaling.of(args, engine_config(device=device))


def test_fixed_replicas_and_their_resources():
    options = scaling("--replicas", "3", "--replica-cpus", "2").deployment_options()
    assert options == {
        "max_ongoing_requests": MAX_ONGOING_REQUESTS,
        "ray_actor_options": {"num_cpus": 2.0, "num_gpus": 0.0},
        "num_replicas": 3,
        "request_router_config": {
            "request_router_class": "omnistage.ray.routing.SessionRouter",
            "request_router_kwargs": {"num_fallback_replicas": 0},  # a session waits for its replica
        },
    }
    module, _, name = options["request_router_config"]["request_router_class"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is SessionRouter  # Serve imports it by that name
    assert scaling("--replica-gpus", "0.25").gpus == 0.25  # several replicas share a card
    assert scaling(device="cuda").gpus == 1.0  # a GPU topology takes its GPUs


def test_autoscaling_between_bounds():
    options = scaling("--autoscale", "1:4", "--target-ongoing-requests", "8").deployment_options()
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 8.0,
        "upscale_delay_s": 30.0,
        "downscale_delay_s": 600.0,
        "look_back_period_s": 30.0,
    }


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replicas", "0"], "--replicas 0: must be at least 1"),
        (["--autoscale", "3:2"], "--autoscale 3:2: give MIN:MAX"),
        (["--autoscale", "two"], "--autoscale two: give MIN:MAX"),
        (["--autoscale", "1:2", "--target-ongoing-requests", "0"], "--target-ongoing-requests 0"),
        (["--replica-gpus", "-1"], "--replica-gpus and --replica-cpus must be at least 0"),
    ],
)
def test_bad_flags_are_named(flags, message):
    with pytest.raises(ConfigError, match=message):
        scaling(*flags)


A = """# HELP omnistage_requests_total Requests
# TYPE omnistage_requests_total counter
omnistage_requests_total{endpoint="/v1/chat/completions",status="200"} 3.0
# HELP omnistage_kv_pages_used Pages used
# TYPE omnistage_kv_pages_used gauge
omnistage_kv_pages_used 5.0
"""
B = A.replace("} 3.0", "} 4.0").replace("used 5.0", "used 0.0")


def test_every_replica_in_one_exposition_each_sample_labelled():
    families = {f.name: f for f in text_string_to_metric_families(merged({"r1": A, "r2": B}).decode())}
    requests = families["omnistage_requests"]
    assert requests.type == "counter"
    assert sorted((s.labels["replica"], s.value) for s in requests.samples) == [("r1", 3.0), ("r2", 4.0)]
    assert all(s.labels["status"] == "200" for s in requests.samples)
    pages = families["omnistage_kv_pages_used"]
    assert {s.labels["replica"]: s.value for s in pages.samples} == {"r1": 5.0, "r2": 0.0}


def test_the_board_forgets_a_replica_that_stopped_posting(monkeypatch):
    clock = iter([0.0, 1.0, 2.0, 12.5])
    monkeypatch.setattr("omnistage.ray.metrics.time.monotonic", lambda: next(clock))
    board = MetricsBoard()
    board.post("r1", A)  # t=0
    board.post("r2", B)  # t=1
    assert set(board.texts()) == {"r1", "r2"}  # t=2
    assert set(board.texts()) == set()  # t=12.5: both silent for over 10 s


def test_the_rayservice_example_reads_as_the_serve_flags():
    example = yaml.safe_load((Path(__file__).parents[3] / "deploy" / "rayservice.yaml").read_text())
    (application,) = yaml.safe_load(example["spec"]["serveConfigV2"])["applications"]
    assert application["import_path"] == "omnistage.ray:app_builder"
    config, options, scaling = app_settings(application["args"])
    assert config.model == "/models/Qwen3-ASR-0.6B" and config.gpu_memory_limit_gib == 30
    assert options.served_model_name == "Qwen3-ASR-0.6B"
    assert (scaling.autoscale, scaling.target_ongoing_requests, scaling.gpus) == ((1, 4), 64.0, 0.25)
    with pytest.raises(
        SystemExit
    ):  # a key that is no flag: argparse's usage error, as `omnistage serve` gives
        app_settings({"replicas_count": "2"})
