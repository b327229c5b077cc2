"""A transcription session's work: each committed turn of audio transcribed as the `/v1/audio/transcriptions`
endpoint transcribes a clip, its text streamed as `conversation.item.input_audio_transcription.delta` events
and ended by `.completed` (or `.failed`)."""

from __future__ import annotations

import asyncio
from typing import Any

from omnistage.request import GenerationRequest, SamplingParams
from omnistage.server.errors import kind_of
from omnistage.server.realtime.conversation import Item, new_id
from omnistage.server.realtime.link import Link
from omnistage.server.realtime.settings import Settings
from omnistage.server.streaming import raise_if_failed, typed_failure


class Transcriber:
    def __init__(self, link: Link, settings: Settings, item: Item) -> None:
        self.link, self.settings, self.item = link, settings, item

    def _request(self) -> GenerationRequest:
        frontend = self.link.pipeline.frontend
        clip = self.item.parts[0].clip
        assert clip is not None  # a committed turn holds its audio
        laid_out = frontend.processor.transcription(
            clip, self.settings.language, self.settings.prompt, frontend.max_model_len
        )
        # OpenAI's transcriptions default to temperature 0; the cap is the clip's length's
        params = SamplingParams(max_tokens=laid_out.max_tokens, temperature=0.0)
        ids, mrope, mm = laid_out.token_ids, laid_out.mrope, laid_out.mm
        return GenerationRequest(new_id("trsc"), ids, params, laid_out.prompt, mrope, mm)

    async def run(self) -> None:
        where = {"item_id": self.item.id, "content_index": 0}
        send = self.link.send
        try:
            new = await asyncio.to_thread(self._request)
            text, tokens = await self._stream(new)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failure = typed_failure(exc, self.item.id)
            kind = kind_of(failure)
            error = {"type": kind.type, "code": kind.code, "message": str(failure)}
            await send(
                {"type": "conversation.item.input_audio_transcription.failed", **where, "error": error}
            )
            return
        self.item.parts[0].text = text
        audio_tokens = sum(getattr(new.mm, "num_audio_tokens", None) or ())
        prompt = len(new.prompt_token_ids)
        usage: dict[str, Any] = {
            "type": "tokens",
            "input_tokens": prompt,
            "output_tokens": tokens,
            "total_tokens": prompt + tokens,
            "input_token_details": {"audio_tokens": audio_tokens, "text_tokens": prompt - audio_tokens},
        }
        event = {"type": "conversation.item.input_audio_transcription.completed", **where}
        await send({**event, "transcript": text, "usage": usage})

    async def _stream(self, new: GenerationRequest) -> tuple[str, int]:
        """The transcript, its new text sent as it grows (a language header held back until the text after it
        begins), and the tokens generated."""
        read = self.link.pipeline.frontend.processor.transcript
        raw, text, tokens, last = "", "", 0, None
        outputs = self.link.pipeline.generate(new)
        try:
            async for output in outputs:
                last = output
                if output.finished:
                    raise_if_failed(output)
                raw += output.outputs[0].delta_text
                tokens = len(output.outputs[0].token_ids)
                _, transcript = read(raw)
                if transcript.startswith(text) and len(transcript) > len(text):
                    delta, text = transcript[len(text) :], transcript
                    event = {"type": "conversation.item.input_audio_transcription.delta", "delta": delta}
                    await self.link.send({**event, "item_id": self.item.id, "content_index": 0})
        finally:
            await outputs.aclose()
            if last is not None:  # counted as an HTTP request's
                self.link.metrics.observe(last)
        return read(raw)[1], tokens
