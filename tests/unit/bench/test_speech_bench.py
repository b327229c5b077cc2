"""The t2s/s2s harness: its arithmetic on fake targets, the command line, transformers on our very weights,
and short runs of every target on the tiny checkpoint (random weights: a few frames of noise)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import uvicorn

from omnistage.bench import speech, speech_targets
from omnistage.bench.hf_speech import build_hf_omni, counting_frames
from omnistage.bench.speech_targets import SpeechInput, SpeechTiming
from omnistage.cli import bind, build_parser
from omnistage.config import engine_config
from omnistage.pipeline.async_pipeline import AsyncPipeline
from omnistage.request import GenerationRequest, SamplingParams, SpeechParams
from omnistage.server import build_app

TEXT_TOKENS, FRAMES = 3, 5


def timing(first: float, latency: float, audio: float, frames: int = 10) -> SpeechTiming:
    return SpeechTiming(first, latency, audio, frames, 4)


def test_summary_of_two_passes():
    passes = [
        [timing(0.1, 1.0, 2.0), timing(0.3, 2.0, 2.0)],  # 4 s of audio in a 2 s pass
        [timing(0.2, 1.0, 4.0), timing(0.4, 3.0, 4.0, frames=9)],  # 8 s in a 4 s pass
    ]
    s = speech.summarize(passes[0] + passes[1], [2.0, 4.0], 2)
    assert (s["concurrency"], s["requests"], s["passes"]) == (2, 2, 2)
    assert s["audio_s"] == 4.0 and s["audio_s_per_s_per_pass"] == [2.0, 2.0] and s["audio_s_per_s"] == 2.0
    assert s["wall_s"] == 3.0  # the median of the two passes' walls
    assert s["first_packet_median_ms"] == 250.0 and s["first_packet_p90_ms"] == pytest.approx(370.0)
    # RTF = latency / audio per request: 0.5, 1.0, 0.25, 0.75
    assert s["rtf_median"] == 0.625 and s["latency_median_ms"] == 1500.0
    assert s["frames"] == [9, 10] and s["text_tokens"] == [4]
    with pytest.raises(ValueError, match="3 requests do not split into 2"):
        speech.summarize(passes[0] + passes[1][:1], [1.0, 1.0], 1)


def test_a_request_without_audio_has_an_infinite_rtf():
    assert math.isinf(timing(0.1, 1.0, 0.0).rtf) and timing(0.1, 1.0, 4.0).rtf == 0.25


def test_sweep_runs_max_c_and_min_requests_per_pass_within_its_concurrency():
    inputs = [SpeechInput(f"p{i}", "hi") for i in range(3)]
    in_flight, seen = 0, []  # (request number, input, requests in flight once it started)

    async def run(item: SpeechInput, number: int) -> SpeechTiming:
        nonlocal in_flight
        in_flight += 1
        seen.append((number, item.name, in_flight))
        await asyncio.sleep(0.02)
        in_flight -= 1
        return timing(0.01, 0.02, 1.0)

    one, five = asyncio.run(speech.sweep(run, inputs, [1, 5], min_requests=4, warmup=1))
    assert seen[0][:2] == (-1, "p0")  # the warm-up
    assert one["requests"] == 4 and five["requests"] == 5  # max(c, min_requests)
    assert [n for n, _, _ in seen[1:]] == list(range(9))  # unique request numbers
    assert [name for _, name, _ in seen[1:5]] == ["p0", "p1", "p2", "p0"]  # cycling over the inputs
    assert max(f for _, _, f in seen[1:5]) == 1 and max(f for _, _, f in seen[5:]) == 5
    assert one["audio_s"] == 4.0 and 0.08 <= one["wall_s"] < 0.4 and five["wall_s"] < one["wall_s"]
    repeated = asyncio.run(speech.sweep(run, inputs, [2], min_requests=1, warmup=0, repeats=3))[0]
    assert repeated["passes"] == 3 and repeated["requests"] == 2


def test_forced_and_natural_lengths():
    assert speech_targets.text_fields(40, True) == {
        "max_tokens": 40,
        "min_tokens": 40,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    assert speech_targets.text_fields(40, False) == {"max_tokens": 40, "temperature": 0.0}
    forced, natural = speech_targets.talker_params(125, True), speech_targets.talker_params(125, False)
    assert (forced.max_tokens, forced.min_tokens, forced.ignore_eos) == (125, 125, True)
    assert (natural.max_tokens, natural.min_tokens, natural.ignore_eos) == (125, 0, False)
    for p in (forced, natural):  # the released sampling otherwise
        assert (p.temperature, p.top_k, p.repetition_penalty) == (0.9, 50, 1.05)


def test_inputs_of_each_workload():
    t2s, s2s = speech_targets.speech_inputs("t2s"), speech_targets.speech_inputs("s2s", espeak=False)
    assert len(t2s) == len(s2s) == speech_targets.NUM_INPUTS and len({i.text for i in t2s}) == len(t2s)
    assert t2s[0].messages() == t2s[0].http_messages() == [{"role": "user", "content": t2s[0].text}]
    assert all(i.clip.seconds == 5.0 for i in s2s)
    assert s2s[0].messages()[0]["content"][0]["type"] == "audio"
    assert s2s[0].http_messages()[0]["content"][0]["input_audio"]["format"] == "wav"


def test_command_line():
    args = build_parser().parse_args(["bench", "t2s", "--load-format", "dummy"])
    assert args.func is speech.main and args.workload == "t2s" and args.concurrency == "1,4,16,32"
    assert (args.text_tokens, args.frames, args.natural, args.tts, args.also) == (40, 125, False, False, None)
    args = build_parser().parse_args(["bench", "s2s", "--also", "t2s", "--also-concurrency", "1,16"])
    assert (args.workload, args.also, args.also_concurrency, args.tts) == ("s2s", "t2s", "1,16", False)
    for wrong in (["s2s", "--tts"], ["t2s", "--also", "t2s"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", *wrong])
    for wrong, message in (
        (["t2s", "--url", "http://h:1", "--baseline", "transformers"], "--baseline runs in-process"),
        (["t2s", "--tts", "--baseline", "transformers"], "no text-to-speech path"),
    ):
        args = build_parser().parse_args(["bench", *wrong])
        with pytest.raises(SystemExit, match=message):
            args.func(args)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Iterator[AsyncPipeline]:
    engine = AsyncPipeline.from_config(
        engine_config(model=str(tiny_checkpoint), device="cpu", num_kv_pages=64)
    )
    yield engine
    engine.shutdown()


def test_transformers_runs_on_our_very_tensors_and_speaks_our_greedy_codes(engine):
    """Every talker, code predictor and Code2Wav parameter is our storage; with greedy Thinker and Talker,
    transformers' generate speaks the very codes our pipeline does, and the same waveform."""
    pipeline = engine.pipeline
    config = json.loads((pipeline.model_path / "config.json").read_text())
    hf, sources = build_hf_omni(pipeline, config)
    assert sources == {"audio_tower": "shared with ours", "visual": "shared with ours"}
    ours = {
        p.data_ptr()
        for m in (
            pipeline.speech_stages.talker,
            pipeline.speech_stages.code_predictor,
            pipeline.speech_stages.code2wav,
        )
        for p in m.parameters()
    }
    theirs = [p for name, p in hf.named_parameters() if not name.startswith("thinker.")]
    assert theirs and all(p.data_ptr() in ours for p in theirs)

    prompt = pipeline.processor.process_chat(SpeechInput("p", "Say something.").messages())
    greedy = SamplingParams(max_tokens=FRAMES, min_tokens=FRAMES, ignore_eos=True, temperature=0.0,
                            repetition_penalty=1.05)  # fmt: skip
    thinker = SamplingParams(**speech_targets.text_fields(TEXT_TOKENS, True))

    async def ours_final():
        speech = SpeechParams(voice="chelsie", talker=greedy)
        async for out in engine.generate(
            GenerationRequest("greedy", prompt.token_ids, thinker, prompt.prompt, speech=speech)
        ):
            final = out
        return final

    final = asyncio.run(ours_final())
    seen = {}
    generate = hf.talker.generate

    def spy(**kwargs):
        seen["result"] = generate(**kwargs)
        return seen["result"]

    hf.talker.generate = spy
    with torch.inference_mode(), counting_frames(hf) as counts:
        sequences, waveform = hf.generate(
            input_ids=torch.tensor([prompt.token_ids]), return_audio=True, speaker="Chelsie",
            thinker_do_sample=False, thinker_max_new_tokens=TEXT_TOKENS, thinker_min_new_tokens=TEXT_TOKENS,
            talker_do_sample=False, talker_max_new_tokens=FRAMES + 1, talker_min_new_tokens=FRAMES + 1,
        )  # fmt: skip
    codes = [step[-1][0].tolist() for step in seen["result"].hidden_states if step[-1] is not None]
    assert counts == [FRAMES] and codes == final.audio_codes
    assert sequences[0, len(prompt.token_ids) :].tolist() == final.outputs[0].token_ids
    # random decoder weights amplify float32 rounding to a few 1e-4 of the peak (tests/parity)
    waveform = waveform.reshape(-1).numpy()
    assert waveform.shape == final.audio.shape
    assert np.abs(waveform - final.audio).max() <= 1e-3 * np.abs(waveform).max()


def test_in_process_t2s_then_s2s_with_the_transformers_baseline(tiny_checkpoint, tmp_path, capsys):
    args = build_parser().parse_args(
        ["bench", "t2s", "--model", str(tiny_checkpoint), "--device", "cpu", "--concurrency", "1,2",
         "--requests", "2", "--also", "s2s", "--text-tokens", str(TEXT_TOKENS), "--frames", str(FRAMES),
         "--baseline", "transformers", "--baseline-requests", "1", "--no-espeak", "--out-dir", str(tmp_path)]
    )  # fmt: skip
    args.func(args)
    t2s, s2s = (json.loads((tmp_path / f"{w}.json").read_text()) for w in ("t2s", "s2s"))
    assert [p["concurrency"] for p in t2s["ours"]] == [1, 2] and [p["concurrency"] for p in s2s["ours"]] == [
        1
    ]
    for result in (t2s, s2s):
        assert result["pools_after"]["full"] and result["engine_start_s"] > 0
        hf = result["transformers"]
        assert hf["requests"] == 1 and hf["first_packet_median_ms"] == hf["latency_median_ms"]
        for p in [*result["ours"], hf]:
            assert p["frames"] == [FRAMES] and p["text_tokens"] == [TEXT_TOKENS]
            # 5 frames at 1920 samples each, less what the causal decoder holds back at the end
            assert 0.3 < p["audio_s"] / p["requests"] <= FRAMES / 12.5
            assert 0 < p["rtf_median"] and p["audio_s_per_s"] > 0
        for p in result["ours"]:
            assert 0 < p["first_packet_median_ms"] < p["latency_median_ms"]
            assert 0 < p["stages_median_ms"]["first_text_token"] < p["first_packet_median_ms"]
        # each request's own text or clip: neither the Thinker's nor the Talker's prefix cache hit, nor the
        # audio tower's cache (s2s: a warm-up and two timed clips, each encoded)
        served = result["caches_served"]
        assert served["prefix_cache_queries"] > 0 and served["talker_prefix_cache_queries"] > 0
        assert served["prefix_cache_hits"] == served["talker_prefix_cache_hits"] == 0
        assert served["encoder_cache_hits"] == 0
    assert s2s["caches_served"]["encoder_cache_misses"] == 3
    printed = capsys.readouterr().out
    assert "s2s: forced 3 text tokens and forced 5 frames (0.4 s of audio)" in printed
    assert "| transformers (not streamed) | 1 | 1 |" in printed


def test_in_process_with_a_topology_file_and_the_flags_on_top(tiny_checkpoint, tmp_path):
    """`--config` takes the YAML file `omnistage serve --config` takes (its pools here); the flags win."""
    topology = tmp_path / "topology.yaml"
    topology.write_text(
        "engine:\n  model: /nowhere\n  device: cuda\n  stages:\n    thinker: {num_kv_pages: 48}\n"
        "    talker: {num_kv_pages: 40}\n"
    )
    args = build_parser().parse_args(
        ["bench", "t2s", "--config", str(topology), "--model", str(tiny_checkpoint), "--device", "cpu",
         "--concurrency", "1", "--requests", "1", "--text-tokens", str(TEXT_TOKENS), "--frames", str(FRAMES),
         "--no-espeak", "--out-dir", str(tmp_path)]
    )  # fmt: skip
    args.func(args)
    t2s = json.loads((tmp_path / "t2s.json").read_text())
    assert t2s["pools_after"] == {"thinker": [48, 48], "talker": [40, 40], "full": True}
    assert t2s["target"]["model"] == str(tiny_checkpoint)


def test_in_process_tts_speaks_the_given_text(engine):
    run = speech_targets.inprocess_runner(engine, True, 40, FRAMES, "aiden", True)
    item = SpeechInput("p", "Hello there, how are you?")
    t = asyncio.run(run(item, 0))
    spoken = item.as_request(0).text  # the request's own text: "Request 0. Hello there, how are you?"
    assert t.frames == FRAMES and t.text_tokens == len(engine.frontend.tts_prompt(spoken).reply_token_ids)
    assert "first_text_token" not in t.stages  # the Thinker did not run
    assert engine.pipeline.stats()["talker_kv_pages_free"] == engine.pipeline.stats()["talker_kv_pages_total"]


@pytest.fixture(scope="module")
def server_url(engine) -> Iterator[str]:
    """The real app on the tiny checkpoint, served by uvicorn on a thread of this process."""
    listener = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "tiny", api_key="k"), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
    listener.close()


@pytest.mark.parametrize("command", [["t2s"], ["t2s", "--tts"], ["s2s"]])
def test_over_http(server_url, command):
    args = build_parser().parse_args(
        ["bench", *command, "--url", server_url, "--api-key", "k", "--concurrency", "1,2", "--requests", "2",
         "--text-tokens", str(TEXT_TOKENS), "--frames", str(FRAMES), "--warmup", "0", "--no-espeak"]
    )  # fmt: skip
    (result,) = speech.run_speech(args).values()
    assert result["target"] == {"url": server_url, "model": "tiny"}
    for p in result["ours"]:
        assert p["requests"] == 2 and p["frames"] == [FRAMES]  # the streams' usage
        assert p["text_tokens"] == [0 if "--tts" in command else TEXT_TOKENS]
        assert 0.3 < p["audio_s"] / 2 <= FRAMES / 12.5  # the pcm16 the stream carried
        assert 0 < p["first_packet_median_ms"] < p["latency_median_ms"]
    # the server's /metrics over the run: its own inputs, though the server saw this test's other runs
    served = result["caches_served"]
    hits = ("prefix_cache_hits", "talker_prefix_cache_hits", "encoder_cache_hits")
    assert [served[k] for k in hits] == [0, 0, 0], served
    assert served["talker_prefix_cache_queries"] > 0


def test_over_http_a_refused_request_stops_the_run_with_the_servers_message(server_url):
    args = build_parser().parse_args(
        ["bench", "t2s", "--url", server_url, "--api-key", "k", "--concurrency", "1", "--requests", "1",
         "--voice", "nobody", "--warmup", "0"]
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="HTTP 400.*unknown voice 'nobody'"):
        speech.run_speech(args)
