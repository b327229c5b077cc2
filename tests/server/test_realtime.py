"""`/v1/realtime` driven by the official `openai` SDK's realtime client, against the tiny checkpoint served in
this process (random weights: the words and the speech are noise, but every event, token and page is real).

Each turn's prompt is caught on its way into the pipeline and compared with the whole conversation rendered
by the processor's chat template, so that what the model reads is shown to be what the client holds.
"""

from __future__ import annotations

import base64
import re
import time

import httpx
import pytest

from omnistage.models.qwen3_omni.code2wav import lookahead_samples
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.server.app import build_app
from tests.server.conftest import serving
from tests.server.realtime_client import (
    INSTRUCTIONS,
    KEY,
    audio_bytes,
    clip_of,
    connect,
    in_loop,
    manual,
    pages_free,
    tone,
    until,
)

pytestmark = pytest.mark.usefixtures("replies_run_to_their_cap")


@pytest.fixture(scope="module")
def url(tiny_pipeline):
    with serving(build_app(tiny_pipeline, "tiny", api_key=KEY)) as base:
        yield base


@pytest.fixture
def prompts(monkeypatch, tiny_pipeline):
    """Every request the server hands the pipeline, in order (the real pipeline still runs it)."""
    seen = []
    generate = tiny_pipeline.generate

    def spy(request, preparing=None):
        seen.append(request)
        return generate(request, preparing)

    monkeypatch.setattr(tiny_pipeline, "generate", spy)
    return seen


@in_loop
async def test_manual_commit_speaks_the_answer(url, tiny_pipeline, prompts):
    async with connect(url) as conn:
        await manual(conn, max_output_tokens=2)
        await conn.input_audio_buffer.append(audio=base64.b64encode(tone(1.0)).decode())
        await conn.input_audio_buffer.commit()
        committed = await until(conn, "conversation.item.done")
        assert [e.type for e in committed] == [
            "input_audio_buffer.committed",
            "conversation.item.added",
            "conversation.item.done",
        ]
        user_item = committed[0].item_id
        await conn.response.create()
        events = await until(conn, "response.done")
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
    ]
    assert kinds[-6:] == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    done = events[-1].response
    assert done.status == "incomplete" and done.status_details.reason == "max_output_tokens"
    (item,) = done.output
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    assert item.content[0].transcript == transcript and transcript
    pcm = audio_bytes(events)
    assert len(pcm) % 2 == 0 and len(pcm) // 2 >= 24_000 // 2  # at least half a second of 24 kHz speech
    assert done.usage.output_token_details.text_tokens == 2
    # a codec frame is 80 ms (1,920 samples at 24 kHz); Code2Wav's last window trims the end a little
    assert abs(done.usage.output_token_details.audio_tokens * 1920 - len(pcm) // 2) < 1920
    # the prompt is the conversation as the chat template renders it: instructions, then the user's audio
    processor = tiny_pipeline.frontend.processor
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": [{"type": "audio", "audio": clip_of(tone(1.0))}]},
    ]
    assert prompts[-1].prompt_token_ids == processor.process_chat(messages, True).token_ids
    assert done.usage.input_tokens == len(prompts[-1].prompt_token_ids)
    assert user_item != item.id
    await pages_free(tiny_pipeline)


@in_loop
async def test_three_turns_hold_the_whole_conversation(url, tiny_pipeline, prompts, streamed):
    processor = tiny_pipeline.frontend.processor
    first, third = tone(0.8, hz=300.0), tone(0.6, hz=500.0)
    async with connect(url) as conn:
        await manual(conn, max_output_tokens=1)
        await conn.input_audio_buffer.append(audio=base64.b64encode(first).decode())
        await conn.input_audio_buffer.commit()
        await conn.response.create()  # spoken
        one = (await until(conn, "response.done"))[-1].response
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And why?"}]}
        )
        await conn.response.create(response={"output_modalities": ["text"], "max_output_tokens": 3})
        two_events = await until(conn, "response.done")
        two = two_events[-1].response
        await conn.input_audio_buffer.append(audio=base64.b64encode(third).decode())
        await conn.input_audio_buffer.commit()
        await conn.response.create(response={"output_modalities": ["text"]})
        three = (await until(conn, "response.done"))[-1].response
    assert [r.status for r in (one, two, three)] == ["incomplete"] * 3
    said = one.output[0].content[0].transcript
    written = two.output[0].content[0].text
    assert written == "".join(e.delta for e in two_events if e.type == "response.output_text.delta")
    assert len(prompts) == 3
    sampled = [streamed[p.request_id][-1].outputs[0].token_ids for p in prompts[:2]]  # the replies' own ids
    assert [processor.decode(ids) for ids in sampled] == [said, written]
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": [{"type": "audio", "audio": clip_of(first)}]},
        {"role": "assistant", "content": said, "token_ids": sampled[0]},
        {"role": "user", "content": "And why?"},
        {"role": "assistant", "content": written, "token_ids": sampled[1]},
        {"role": "user", "content": [{"type": "audio", "audio": clip_of(third)}]},
    ]
    assert prompts[2].prompt_token_ids == processor.process_chat(messages, True).token_ids
    # each turn's prompt begins with the one before it: the conversation only grows
    for earlier, later in zip(prompts, prompts[1:]):
        assert later.prompt_token_ids[: len(earlier.prompt_token_ids) - 3] == earlier.prompt_token_ids[:-3]
    assert three.usage.input_token_details.audio_tokens > one.usage.input_token_details.audio_tokens
    await pages_free(tiny_pipeline)


@in_loop
async def test_cancel_mid_answer_frees_every_page(url, tiny_pipeline):
    async with connect(url) as conn:
        await manual(conn, max_output_tokens=64)
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk."}]}
        )
        await conn.response.create()
        await until(conn, "response.output_audio.delta")
        assert tiny_pipeline.stats()["kv_pages_used"] > 0
        started = time.monotonic()
        await conn.response.cancel()
        done = (await until(conn, "response.done"))[-1].response
        took = time.monotonic() - started
        assert done.status == "cancelled" and done.status_details.reason == "client_cancelled"
        assert done.output[0].status == "incomplete"
        await pages_free(tiny_pipeline)
        assert took < 5  # one step of the tiny model, not the rest of 64 tokens' speech
        # the session goes on: a cancel with nothing running is an error, and the next response runs
        await conn.response.cancel()
        (error,) = await until(conn, "error")
        assert error.error.code == "response_cancel_not_active"
        await conn.response.create(response={"output_modalities": ["text"], "max_output_tokens": 1})
        assert (await until(conn, "response.done"))[-1].response.status == "incomplete"
    metrics = httpx.get(f"{url}/metrics").text
    assert float(re.search(r"^omnistage_realtime_barge_ins_total (\S+)$", metrics, re.M)[1]) >= 1
    assert re.search(r'^omnistage_realtime_responses_total\{status="cancelled"\} ', metrics, re.M)


@pytest.fixture
def streamed(monkeypatch, prompts, tiny_pipeline):
    """Every output the pipeline streams to the server, by request id (the requests are in `prompts` too)."""
    seen: dict[str, list] = {}
    generate = tiny_pipeline.generate

    async def spy(request, preparing=None):
        outputs = generate(request, preparing)
        try:
            async for output in outputs:
                seen.setdefault(request.request_id, []).append(output)
                yield output
        finally:
            await outputs.aclose()

    monkeypatch.setattr(tiny_pipeline, "generate", spy)
    return seen


@in_loop
async def test_truncate_keeps_the_text_of_the_frames_heard(
    url, tiny_pipeline, tiny_checkpoint, prompts, streamed
):
    """The Talker reads the reply's first token in its prompt and one more with each frame after (transformers'
    `trailing_text_hidden`): frame k is made having read min(k + 1, spoken) tokens. The user stops the audio in
    the middle of frame p, having heard frames 0 .. p - 1 whole: the item keeps the reply's first p tokens."""
    processor = tiny_pipeline.frontend.processor
    code2wav = Qwen3OmniConfig.from_dir(tiny_checkpoint).code2wav
    spf, lookahead = code2wav.samples_per_frame, lookahead_samples(code2wav)
    async with connect(url) as conn:
        await manual(conn, max_output_tokens=6)
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Hello there."}],
            }
        )
        await conn.response.create()
        events = await until(conn, "response.done")
        item = events[-1].response.output[0]
        said = item.content[0].transcript
        (answer,) = [outputs for request_id, outputs in streamed.items() if request_id.startswith("rt")]
        ids, frames = answer[-1].outputs[0].token_ids, answer[-1].num_audio_frames
        spoken = len(ids) - 1  # the Thinker's last token is never spoken
        heard = min(spoken - 1, frames - 1)  # frames heard whole: fewer than the tokens spoken
        assert heard >= 1
        # frame k's audio ends at sample spf·(k + 1) − lookahead; stop halfway through frame `heard`
        heard_ms = (spf * heard - lookahead + spf // 2) * 1000 // 24_000
        await conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=heard_ms)
        (truncated,) = await until(conn, "conversation.item.truncated")
        assert (truncated.item_id, truncated.audio_end_ms) == (item.id, heard_ms)
        await conn.conversation.item.retrieve(item_id=item.id)
        kept = (await until(conn, "conversation.item.retrieved"))[-1].item.content[0].transcript or ""
        await conn.response.create(response={"output_modalities": ["text"], "max_output_tokens": 1})
        await until(conn, "response.done")
        # past the audio's end is refused
        await conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=10**6)
        assert (await until(conn, "error"))[-1].error.param == "audio_end_ms"
    assert kept == processor.decode(ids[:heard]) and said == processor.decode(ids)
    # the next turn's prompt is the conversation with the truncated answer, as the chat template renders it,
    # the answer's tokens as they were sampled
    head = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Hello there."}]
    cut = processor.encode_chat([*head, {"role": "assistant", "content": kept, "token_ids": ids[:heard]}])[1]
    whole = processor.encode_chat([*head, {"role": "assistant", "content": said, "token_ids": ids}])[1]
    assert prompts[-1].prompt_token_ids == cut != whole
    assert cut[-5 - heard : -5] == ids[:heard]  # before <|im_end|>\n<|im_start|>assistant\n


@in_loop
async def test_g711_out_at_8_khz(url, tiny_pipeline):
    async with connect(url) as conn:
        await manual(conn, max_output_tokens=1, audio={"output": {"format": {"type": "audio/pcmu"}}})
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]}
        )
        await conn.response.create()
        events = await until(conn, "response.done")
    done = events[-1].response
    assert done.audio.output.format.type == "audio/pcmu"
    samples = len(audio_bytes(events))  # one byte a sample
    assert abs(samples - done.usage.output_token_details.audio_tokens * 640) < 640  # 80 ms frames at 8 kHz


@in_loop
async def test_a_conversation_can_have_its_users_turns_transcribed_too(url, tiny_pipeline, prompts):
    async with connect(url) as conn:
        audio = {"input": {"transcription": {"model": "whisper-1", "language": "en"}}}
        await manual(conn, output_modalities=["text"], max_output_tokens=2, audio=audio)
        await conn.input_audio_buffer.append(audio=base64.b64encode(tone(1.0)).decode())
        await conn.input_audio_buffer.commit()
        (committed, *_) = await until(conn, "conversation.item.done")
        await conn.response.create()
        events = await until(conn, "conversation.item.input_audio_transcription.completed")
        if not any(e.type == "response.done" for e in events):
            events += await until(conn, "response.done")
    completed = next(e for e in events if e.type == "conversation.item.input_audio_transcription.completed")
    deltas = [e for e in events if e.type == "conversation.item.input_audio_transcription.delta"]
    assert completed.item_id == committed.item_id and all(e.item_id == committed.item_id for e in deltas)
    assert completed.transcript == "".join(e.delta for e in deltas)
    # the transcription is a request of its own, on the turn's clip; the answer's prompt is unchanged by it
    (transcribing,) = [p for p in prompts if p.request_id.startswith("trsc")]
    assert transcribing.params.temperature == 0.0
    answer = next(p for p in prompts if p.request_id.startswith("rt"))
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": [{"type": "audio", "audio": clip_of(tone(1.0))}]},
    ]
    assert answer.prompt_token_ids == tiny_pipeline.frontend.processor.process_chat(messages, True).token_ids
