"""The speech hand-off's prompts on the GPU: built without waiting for the work queued on the device, and equal
to the CPU's (tiny checkpoint's Talker, float32)."""

import time

import pytest
import torch

from omnistage.engine.attention import TorchReferenceBackend
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.talker import load_talker
from omnistage.models.qwen3_omni.talker_input import (
    PromptSource,
    SpeechTokens,
    TtsEmbeds,
    talker_prompts,
    text_rows,
)

pytestmark = pytest.mark.gpu

NEWLINE, WORD, IM_END = 198, 1000, 151645


@torch.no_grad()
def test_a_burst_of_prompts_is_built_without_waiting_for_the_device(tiny_checkpoint):
    cfg = Qwen3OmniConfig.from_dir(tiny_checkpoint)
    tokens = SpeechTokens.from_config(cfg)
    generator = torch.Generator().manual_seed(0)
    embedding = torch.nn.Embedding(cfg.thinker.text.vocab_size, cfg.talker.thinker_hidden_size)
    embedding.weight.copy_(torch.randn(embedding.weight.shape, generator=generator))
    audio = tokens.placeholders[0]
    sources = []
    for i in range(64):  # a c=64 burst's first tokens, every fourth request with a clip
        body = [audio] * 3 + [WORD + i] if i % 4 == 0 else [WORD + i, WORD]
        ids = [
            tokens.im_start,
            tokens.user,
            NEWLINE,
            *body,
            IM_END,
            NEWLINE,
            tokens.im_start,
            tokens.assistant,
        ]
        ids = torch.tensor([*ids, NEWLINE])
        hidden = torch.randn(body.count(audio), cfg.thinker.text.hidden_size, generator=generator)
        sources.append(PromptSource(ids, hidden, 2000 + i, tokens.speaker_id("ethan")))
    tts = TtsEmbeds(*torch.randn(3, cfg.talker.text.hidden_size, generator=generator))

    built = {}
    for device in ("cpu", "cuda"):
        talker = load_talker(tiny_checkpoint, LoadOptions(torch.float32, device), TorchReferenceBackend())
        table = text_rows(talker, embedding.to(device))
        on = [PromptSource(s.ids, s.media_hidden.to(device), s.first_token, s.speaker_id) for s in sources]
        device_tts = TtsEmbeds(*(t.to(device) for t in (tts.bos, tts.eos, tts.pad)))
        if device == "cuda":
            # a first burst of the same sizes loads the kernels (lazily, which may wait for the device) and fills
            # the caching allocators (a new pinned or device block may wait too), as a server's earlier steps do:
            # what is timed is the steady state
            talker_prompts(talker, tokens, device_tts, table, on)
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000_000)  # ~1 s of clock cycles queued before the hand-off
            queued = torch.cuda.Event()
            queued.record()
            torch.cuda.set_sync_debug_mode("error")
            started = time.perf_counter()
            try:
                built[device] = talker_prompts(talker, tokens, device_tts, table, on)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            host_ms = 1e3 * (time.perf_counter() - started)
            assert not queued.query(), (
                f"the hand-off waited for the queued work ({host_ms:.1f} ms on the host)"
            )
            torch.cuda.synchronize()
        else:
            built[device] = talker_prompts(talker, tokens, device_tts, table, on)
    for cpu, gpu in zip(built["cpu"], built["cuda"], strict=True):
        assert torch.equal(cpu.rope_ids, gpu.rope_ids) and gpu.embeds.is_cuda
        torch.testing.assert_close(gpu.embeds.cpu(), cpu.embeds, rtol=1e-4, atol=1e-4)
