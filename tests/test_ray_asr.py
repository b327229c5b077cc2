"""benchmarks/ray_asr.py's own arithmetic: the replicas' shares of one machine, and the table of its parts (the
runs themselves need Ray and the GPU: `DEVICE=cpu MODEL=tiny ... bash benchmarks/ray_asr.sh` smoke-tests them)."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "ray_asr.py"


@pytest.fixture(scope="module")
def ray_asr():
    spec = importlib.util.spec_from_file_location("ray_asr", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ray_asr"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["ray_asr"]


def flag(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


def test_replicas_share_the_card_the_cpus_and_the_memory(ray_asr):
    four = ray_asr.replica_flags(4, cpus=16, gpu=True, memory_gib=120)
    assert flag(four, "--replicas") == "4"
    assert float(flag(four, "--replica-gpus")) * 4 == 1.0
    assert flag(four, "--replica-cpus") == "4"
    assert flag(four, "--gpu-memory-limit-gib") == "30"
    three = ray_asr.replica_flags(3, cpus=16, gpu=True, memory_gib=100)
    assert flag(three, "--replica-gpus") == "0.3333"  # Ray takes at most 4 decimals; 3 x 0.3333 fits one card
    assert flag(three, "--replica-cpus") == "5"
    assert float(flag(three, "--gpu-memory-limit-gib")) == pytest.approx(100 / 3, abs=1e-3)


def test_a_lone_replica_plans_its_memory_as_the_single_server(ray_asr):
    one = ray_asr.replica_flags(1, cpus=16, gpu=True, memory_gib=120)
    assert flag(one, "--replica-gpus") == "1.0"
    assert flag(one, "--replica-cpus") == "16"
    assert "--gpu-memory-limit-gib" not in one


def test_on_a_cpu_replicas_take_no_gpu_and_at_least_one_cpu(ray_asr):
    two = ray_asr.replica_flags(2, cpus=1, gpu=False, memory_gib=120)
    assert flag(two, "--replica-gpus") == "0"
    assert flag(two, "--replica-cpus") == "1"
    assert "--gpu-memory-limit-gib" not in two


def passes(*rows):
    return [
        {"concurrency": c, "rtf": rtf, "ttft_median_ms": ttft, "ttft_p90_ms": ttft * 2, "tpot_median_ms": 5.0}
        for c, rtf, ttft in rows
    ]


def test_table_puts_each_part_beside_the_single_server(ray_asr):
    parts = [
        {"target": "ray2", "replicas": 2, "start_s": 61.0, "passes": passes((128, 1200.0, 300.0))},
        {
            "target": "ray1",
            "replicas": 1,
            "start_s": 48.0,
            "passes": passes((1, 60.0, 17.5), (128, 790.0, 340.0)),
        },
        {
            "target": "single",
            "replicas": 0,
            "start_s": 35.0,
            "passes": passes((1, 64.0, 15.0), (128, 800.0, 330.0)),
        },
    ]
    lines = ray_asr.table(parts)
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[:3] for row in rows] == [
        ["| single", "-", "1"], ["| single", "-", "128"], ["| ray1", "1", "1"], ["| ray1", "1", "128"],
        ["| ray2", "2", "128"],
    ]  # fmt: skip
    assert rows[3].split(" | ")[4] == "0.988"  # 790 / 800
    assert rows[4].split(" | ")[4] == "1.500"
    assert lines[-1].endswith("17.5 ms through one replica vs 15.0 ms on the single server: +2.5 ms")


def test_table_without_the_single_server_has_no_ratio_nor_overhead(ray_asr):
    lines = ray_asr.table(
        [{"target": "ray4", "replicas": 4, "start_s": 80.0, "passes": passes((128, 1500.0, 250.0))}]
    )
    assert lines[-1].split(" | ")[4] == "-"
    assert not any("ingress" in line for line in lines)
