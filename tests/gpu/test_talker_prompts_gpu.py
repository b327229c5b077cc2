"""The speech hand-off's prompts on the GPU: built without waiting for the work queued on the device, and equal
to the CPU's (tiny checkpoint's Talker, float32)."""

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
            # a first call loads its kernels (lazily, which may wait for the device), as a server's warm-up does
            talker_prompts(talker, tokens, device_tts, table, on[:2])
            torch.cuda.synchronize()
            torch.cuda._sleep(1_000_000_000)  # ~0.5 s of clock cycles queued before the hand-off
            queued = torch.cuda.Event()
            queued.record()
            torch.cuda.set_sync_debug_mode("error")
            try:
                built[device] = talker_prompts(talker, tokens, device_tts, table, on)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert not queued.query()  # the sleep still runs: nothing waited for it
            torch.cuda.synchronize()
        else:
            built[device] = talker_prompts(talker, tokens, device_tts, table, on)
    for cpu, gpu in zip(built["cpu"], built["cuda"], strict=True):
        assert torch.equal(cpu.rope_ids, gpu.rope_ids) and gpu.embeds.is_cuda
        torch.testing.assert_close(gpu.embeds.cpu(), cpu.embeds, rtol=1e-4, atol=1e-4)
