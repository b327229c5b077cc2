import numpy as np
import pytest
import torch

from omnistage.engine.encoder_engine import EncoderEngine
from omnistage.errors import InvalidRequest
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.processor import Processor


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    cfg = Qwen3OmniConfig.from_dir(tiny_checkpoint).thinker
    encoders = EncoderEngine(tiny_checkpoint, cfg, torch.float32, torch.device("cpu"))
    clip = (0.3 * np.sin(np.arange(32000) / 16000 * 2 * np.pi * 440)).astype(np.float32)
    messages = [{"role": "user", "content": [{"type": "audio", "audio": clip}, {"type": "text", "text": "Hi"}]}]
    return cfg, encoders, Processor(tiny_checkpoint).process_chat(messages)


def test_rows_point_at_the_placeholders(setup):
    cfg, encoders, prompt = setup
    embeds = encoders.encode(prompt.token_ids, prompt.mm)
    expected = [i for i, t in enumerate(prompt.token_ids) if t == cfg.audio_token_id]
    assert embeds.audio_rows.tolist() == expected
    assert embeds.audio_embeds.shape == (len(expected), cfg.text.hidden_size)
    assert embeds.image_embeds is None and embeds.deepstack is None and len(embeds.image_rows) == 0


def test_placeholders_that_do_not_match_the_media_are_refused(setup):
    cfg, encoders, prompt = setup
    ids = prompt.token_ids + [cfg.audio_token_id]
    count = ids.count(cfg.audio_token_id)
    with pytest.raises(InvalidRequest) as err:
        encoders.encode(ids, prompt.mm)
    assert str(err.value) == f"the prompt has {count} audio placeholder tokens but its audio gives {count - 1}"
