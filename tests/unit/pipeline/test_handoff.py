"""Which of a spoken reply's text tokens each codec frame was made from (`SpokenFrame`), on the tiny checkpoint
(CPU, float32): the counts the outputs carry are those of the text rows the Talker was actually given.

transformers' `Qwen3OmniMoeForConditionalGeneration.generate` puts the reply's first token in the Talker's
prompt (`_get_talker_assistant_parts`: the row after tts_bos) and adds `trailing_text_hidden[k]` (token k + 2,
then tts_eos, then tts_pad) to the input of the step after frame k (`Talker.prepare_inputs_for_generation`), so
frame k is sampled having read min(k + 1, spoken) tokens.
"""

from __future__ import annotations

import pytest
import torch

from omnistage import LLM, SamplingParams
from omnistage.engine.stages.text_setup import NewRequest
from omnistage.request import SpeechParams, talker_sampling_defaults


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), device="cpu", dtype="float32", page_size=4)


def speaking(
    llm: LLM, request_id: str, text_tokens: int, frames: int, reply: str | None = None
) -> NewRequest:
    """A request whose Talker makes exactly `frames` frames of the Thinker's `text_tokens` tokens, or of the given
    `reply`."""
    fields = vars(talker_sampling_defaults()) | {
        "max_tokens": frames,
        "min_tokens": frames,
        "ignore_eos": True,
        "seed": 7,
    }
    talker = SamplingParams(**fields)
    if reply is not None:
        tts = llm.pipeline.frontend.tts_prompt(reply)
        speech = SpeechParams("ethan", talker, reply_token_ids=tts.reply_token_ids)
        return NewRequest(request_id, tts.token_ids, SamplingParams(), tts.prompt, speech=speech)
    prompt = llm.pipeline.processor.process_chat([{"role": "user", "content": "Tell me about rain."}])
    return NewRequest(
        request_id,
        prompt.token_ids,
        SamplingParams(max_tokens=text_tokens, temperature=0.0),
        prompt.prompt,
        prompt.mrope,
        prompt.mm,
        SpeechParams("ethan", talker),
    )


def run_watching_the_talker(llm: LLM, new: NewRequest, monkeypatch) -> tuple[list, list[int]]:
    """Every output of `new`, and for each frame the text tokens the Talker had been given when it sampled the
    frame: counted from the rows it was fed (each fed row less the frame's codec sum is the text row: a
    token's projected row, or tts_eos / tts_pad)."""
    pipeline = llm.pipeline
    handoff = pipeline.steps.handoff
    stage = pipeline.speech_stages.talker_stage
    text_rows, tts = handoff.text_rows, handoff.tts
    read_by_feed: list[int] = []  # after each fed row: the text tokens read so far
    feed = stage.feed

    def watch(request_id: str, row: torch.Tensor) -> None:
        speech = pipeline._speaking[request_id]
        text_row = row - speech.codec_sum
        spoken = speech.spoken
        read = read_by_feed[-1] if read_by_feed else 1  # the prompt holds the first spoken token
        nxt = len(read_by_feed) + 1  # the row of this feed is spoken token `nxt` where there is one
        if nxt < len(spoken) and torch.allclose(text_row, text_rows[spoken[nxt]], atol=1e-4):
            read += 1
        else:
            assert any(torch.allclose(text_row, end, atol=1e-4) for end in (tts.eos, tts.pad))
        read_by_feed.append(read)
        feed(request_id, row)

    monkeypatch.setattr(stage, "feed", watch)
    assert pipeline.add_requests([new]) == [None]
    outputs = []
    while pipeline.has_unfinished():
        outputs += [o for o in pipeline.step() if o.request_id == new.request_id]
    # frame k is sampled from the step after the k-th row was fed (frame 0 from the prompt)
    frames = outputs[-1].num_audio_frames
    return outputs, [1] + read_by_feed[: frames - 1]


@pytest.mark.parametrize(
    ("text_tokens", "frames"),
    [(8, 20), (12, 6)],
    ids=["the text runs out first", "the audio stops first"],
)
def test_each_frame_carries_the_text_the_talker_had_read(llm, monkeypatch, text_tokens, frames):
    new = speaking(llm, f"aligned-{text_tokens}", text_tokens, frames)
    outputs, read = run_watching_the_talker(llm, new, monkeypatch)
    final = outputs[-1]
    spoken = len(final.outputs[0].token_ids) - 1  # the Thinker's last token is never spoken
    assert final.num_audio_frames == frames and spoken == text_tokens - 1
    reported = [frame for out in outputs for frame in out.spoken_frames]
    assert [frame.text_tokens for frame in reported] == read == [min(k + 1, spoken) for k in range(frames)]
    # each frame goes out with the audio that completes it: its end is within the audio out so far
    code2wav = llm.pipeline.speech_stages.code2wav
    assert [frame.audio_end for frame in reported] == [code2wav.num_samples(k + 1) for k in range(frames)]
    samples = 0
    for out in outputs:
        samples += len(out.audio_delta) if out.audio_delta is not None else 0
        assert all(frame.audio_end <= samples for frame in out.spoken_frames)
    assert reported[-1].audio_end == samples == len(final.audio)


def test_a_given_reply_is_read_by_the_same_rule(llm, monkeypatch):
    new = speaking(llm, "aligned-reply", 0, 15, reply="Good morning, and welcome to the show.")
    outputs, read = run_watching_the_talker(llm, new, monkeypatch)
    spoken = len(outputs[-1].outputs[0].token_ids)
    reported = [frame for out in outputs for frame in out.spoken_frames]
    assert [frame.text_tokens for frame in reported] == read == [min(k + 1, spoken) for k in range(15)]
    assert 2 < spoken < 15 and reported[-1].audio_end == len(outputs[-1].audio)
