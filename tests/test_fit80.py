"""benchmarks/fit80.py: a CPU smoke run on the embedded tiny checkpoint and configs/tiny.yaml (the batch of image,
audio, video (text and speech out), S2S and T2S requests at once, then A2T on the pipeline, its release and a rebuild without the cap), and its
per-stage graph report over hand-made plans of two devices (what a GPU run fills)."""

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from omnistage.engine.memory.plan import DeviceMemory, GraphCandidates, KVPool, MiB, StageMemory
from omnistage.engine.memory.planner import plan_device

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "fit80.py"


@pytest.fixture
def fit80(monkeypatch):
    spec = importlib.util.spec_from_file_location("fit80", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fit80", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_fit80_smoke(fit80, tmp_path, capsys):
    results = fit80.main(["--tiny", "--device", "cpu", "--gpu-memory-limit-gib", "80", "--out-dir", str(tmp_path),
                          "--images", "64x64", "96x64", "--clip-seconds", "2", "--s2s", "1", "--t2s", "1",
                          "--video-seconds", "1.5", "--video-size", "64x48", "--video-fps", "2",
                          "--s2s-clip-seconds", "1.5", "--frames", "5", "--text-tokens", "3", "--output-tokens", "2",
                          "--a2t-compare", "--uncapped", "--a2t-clips", "2", "--a2t-output-tokens", "2",
                          "--passes", "1", "--no-espeak"])  # fmt: skip
    assert results["all_ok"]
    assert json.loads((tmp_path / "fit80_tiny_80gib.json").read_text()) == json.loads(json.dumps(results))
    capped, uncapped = results["runs"]
    assert (capped["label"], capped["gpu_memory_limit_gib"]) == ("80gib", 80.0)
    assert (uncapped["label"], uncapped["gpu_memory_limit_gib"]) == ("uncapped", None)

    batch = capped["batch"]
    requests = {r["name"]: r for r in batch["requests"]}
    assert list(requests) == [
        "image-64x64",
        "image-96x64",
        "audio-2s",
        "video-1.5s",
        "v2s-1.5s",
        "s2s-0",
        "t2s-0",
    ]
    assert all(r["ok"] and r["error"] is None and r["prompt_tokens"] > 0 for r in requests.values())
    assert [requests[n]["output_tokens"] for n in requests] == [2, 2, 2, 2, 3, 3, 3]
    for name in ("v2s-1.5s", "s2s-0", "t2s-0"):
        assert requests[name]["frames"] == 5 and requests[name]["audio_s"] > 0
    assert "frames" not in requests["audio-2s"] and "frames" not in requests["video-1.5s"]
    # the video's frames and its sound track interleaved: more prompt than the 2 s clip alone
    video = requests["video-1.5s"]
    assert video["prompt_tokens"] > requests["audio-2s"]["prompt_tokens"] / 2
    assert 0 < video["first_token_s"] <= video["wall_s"] and video["preprocess_s"] > 0
    assert batch["pages_all_free"]
    assert all(free == total > 0 for free, total in batch["kv_pages_free_total"].values())
    assert set(batch["kv_pages_free_total"]) == {"thinker", "talker"}
    assert batch["peak_by_device"] == {}  # the CPU: no allocator peaks

    # every stage's graph fields, empty on the CPU (no plan, nothing captured)
    assert list(capped["graphs"]) == [key for key, _, _ in fit80.GRAPH_SETS]
    for graphs in capped["graphs"].values():
        assert graphs["candidates"] == graphs["planned"] == graphs["captured"] == []
        assert graphs["all_captured"] is False and graphs["device"] is None
    assert capped["plans"] == {} and capped["start_s"] > 0

    assert capped["release"]["released"] and "batch" not in uncapped
    compare = results["a2t_compare"]
    assert (
        compare["capped_rtf"] == capped["a2t"]["rtf"] > 0
        and compare["uncapped_rtf"] == uncapped["a2t"]["rtf"] > 0
    )
    assert compare["ratio"] == round(compare["capped_rtf"] / compare["uncapped_rtf"], 4)
    assert capped["a2t"]["requests"] == 2 and capped["a2t"]["output_tokens"] == 4

    printed = capsys.readouterr().out
    assert "s2s-0            ok" in printed and "A2T c=1 RTF: capped" in printed


def test_video_requests_name_one_file_with_its_sound(fit80, tmp_path):
    inputs = fit80.TINY
    text, spoken = fit80.SamplingParams(max_tokens=2), fit80.SamplingParams(max_tokens=3)
    speech = fit80.SpeechParams(voice="ethan")
    video, v2s = fit80.video_requests(inputs, tmp_path, text, spoken, speech)
    assert (video.name, video.kind, video.speech, v2s.name, v2s.kind) == (
        "video-2s",
        "video",
        None,
        "v2s-2s",
        "v2s",
    )
    assert video.params is text and v2s.params is spoken and v2s.speech is speech
    assert video.video == v2s.video == fit80.VideoOptions(use_audio_in_video=True, fps=2.0)
    part = video.messages[0]["content"][0]
    assert part["type"] == "video" and v2s.messages == video.messages
    decoded = fit80.decode_messages(video.messages, fit80.OFFLINE_MEDIA, video.video)[0]["content"][0][
        "video"
    ]
    # 2 s at 2 fps, each 64x48 frame scaled up to the processor's least pixels; the track 0.1 s short of 2 s
    assert decoded.frames.shape == (4, 320, 448, 3) and decoded.fps == 2.0
    assert decoded.audio is not None and 1.85 < len(decoded.audio) / 16000 < 2.0
    assert (
        fit80.video_requests(fit80.replace(inputs, video_seconds=0.0), tmp_path, text, spoken, speech) == []
    )


def runner(captured: list[int], each: int) -> SimpleNamespace:
    """A graph runner as the stages hold them: its captured buckets and the bytes each capture added."""
    return SimpleNamespace(captured_buckets=captured, graph_bytes={b: each for b in captured})


def test_graph_report_two_devices(fit80):
    """Per stage, the graph set of the plan of its own device beside what its runner holds (two-GPU topology)."""
    thinker = StageMemory(
        kv=(KVPool("Thinker", MiB, 1),),
        graphs=(
            GraphCandidates("Thinker", "decode", "batch", {1: 10 * MiB, 2: 20 * MiB, 4: 900 * MiB}),
            GraphCandidates("vision encoder", "prefill", "patches", {1024: 5 * MiB}),
        ),
    )
    speech = StageMemory(
        kv=(KVPool("Talker", MiB, 1),),
        graphs=(GraphCandidates("Code2Wav", "decode", "chunk x streams", {(2, 1): MiB, (25, 1): 2 * MiB}),),
    )
    device = DeviceMemory(1 << 40, 1 << 40, 0, None, "cuda:0")
    code2wav = runner([(2, 1)], MiB)
    pipeline = SimpleNamespace(
        speaks=True,
        thinker=SimpleNamespace(
            runner=SimpleNamespace(graphs=runner([1, 2], 8 * MiB), prefill_graphs=None),
            encoders=SimpleNamespace(audio_graphs=None, vision_graphs=runner([1024], 4 * MiB)),
        ),
        plans={
            "cuda:0": plan_device(device, [thinker], graph_budget=40 * MiB),
            "cuda:1": plan_device(replace(device, name="cuda:1"), [speech]),
        },
        speech_stages=SimpleNamespace(
            talker_stage=SimpleNamespace(runner=SimpleNamespace(graphs=None)),
            frame_graphs=runner([], 0),
            code2wav_graphs=code2wav,
        ),
    )
    report = fit80.graph_report(pipeline)
    assert list(report) == [key for key, _, _ in fit80.GRAPH_SETS]
    decode = report["thinker_decode"]
    assert (decode["device"], decode["unit"]) == ("cuda:0", "batch")
    assert (decode["candidates"], decode["planned"], decode["eager"], decode["captured"]) == (
        [1, 2, 4], [1, 2], [4], [1, 2]
    )  # fmt: skip
    assert decode["planned_gib"] == round(30 * MiB / (1 << 30), 3) and not decode["all_captured"]
    vision = report["vision_encoder"]
    assert vision["candidates"] == vision["captured"] == [1024] and vision["all_captured"]
    assert report["audio_encoder"]["candidates"] == [] and not report["audio_encoder"]["all_captured"]
    c2w = report["code2wav"]
    assert (c2w["device"], c2w["unit"]) == ("cuda:1", "chunk x streams")
    assert (c2w["candidates"], c2w["planned"], c2w["captured"]) == ([[2, 1], [25, 1]],) * 2 + ([[2, 1]],)
    assert not c2w["all_captured"] and c2w["captured_gib"] == round(MiB / (1 << 30), 3)
    assert report["talker"]["captured"] == [] and report["code_predictor"]["device"] is None
    json.dumps(report)  # all of it goes into the JSON
