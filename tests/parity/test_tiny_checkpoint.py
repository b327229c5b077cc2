"""transformers, the oracle, reads the tiny checkpoint exactly as it reads the released one."""

import torch
from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration


def test_transformers_loads_it_with_no_missing_or_unexpected_keys(tiny_checkpoint):
    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        tiny_checkpoint, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert model.config.thinker_config.audio_token_id == 151675


def test_transformers_loads_the_thinking_checkpoint_without_a_talker(tiny_thinking_checkpoint):
    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        tiny_thinking_checkpoint, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not model.has_talker and not hasattr(model, "talker")


def test_tokenizer_speaks_the_real_qwen_vocabulary(tiny_checkpoint):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert tok.encode("<|im_start|>user") == [151644, 872]
    assert tok.encode("Hello world, this is a test.") == [9707, 1879, 11, 419, 374, 264, 1273, 13]
    assert tok.encode("2024") == [17, 15, 17, 19]  # Qwen splits digits one by one
    ids = {
        t: tok.convert_tokens_to_ids(t)
        for t in ("<|audio_pad|>", "<|image_pad|>", "<|video_pad|>", "<tts_pad>")
    }
    assert ids == {
        "<|audio_pad|>": 151675,
        "<|image_pad|>": 151655,
        "<|video_pad|>": 151656,
        "<tts_pad>": 151671,
    }
    assert tok.eos_token_id == 151645


def test_chat_template_frames_media_placeholders(tiny_checkpoint):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "audio"}, {"type": "image"}, {"type": "text", "text": "What is this?"}],
        },
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>"
        "<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
