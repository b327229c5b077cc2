"""The engine on audio and image prompts against transformers' thinker (CPU, float32, tiny checkpoint).

Our processor, encoders, placeholder merge, deepstack and M-RoPE run through `LLM.chat`; transformers'
thinker gets its own processor's tensors for the same messages. Clip lengths are whole 10 ms hops (see
test_processor_parity).
"""

from __future__ import annotations

import pytest
import torch
from media_samples import audio, clips_alone, image, picture, reference, speech, text, tones

from omnistage import LLM, SamplingParams

STEPS = 16
CASES = {
    "two_audios_one_image": lambda: [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [audio(speech()), text("and"), image(picture(64, 96)), text("then")]},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": [audio(tones(2.3, seed=1)), text("Describe both.")]},
    ],
    "audio": lambda: [{"role": "user", "content": [audio(tones(1.7, seed=5)), text("What is this sound?")]}],
    "image": lambda: [{"role": "user", "content": [image(picture(128, 64, seed=2)), text("What is this?")]}],
}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint), device="cpu", dtype="float32", page_size=4, num_kv_pages=512)


def prefill_logits(llm, messages, **chat):
    """Our last-token logits of the prompt (the first sampled step); `chat`: LLM.chat's other arguments."""
    captured = []
    runner = llm.engine.runner
    real = runner.execute

    def spy(step):
        captured.append(real(step))
        return captured[-1]

    runner.execute = spy
    try:
        out = llm.chat(messages, SamplingParams(max_tokens=1, temperature=0.0), **chat)[0]
    finally:
        runner.execute = real
    return out, captured[0][-1]


@pytest.mark.parametrize("case", CASES)
def test_logits_and_greedy_tokens_match_transformers(case, llm, hf_processor, hf_thinker):
    messages = CASES[case]()
    out, ours = prefill_logits(llm, messages)
    ref = clips_alone(hf_processor, reference(hf_processor, out.prompt, messages), messages)
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    with torch.no_grad():
        theirs = hf_thinker(**ref).logits[0, -1]
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= 1e-4

    params = SamplingParams(max_tokens=STEPS, min_tokens=STEPS, temperature=0.0, ignore_eos=True)
    tokens = llm.chat(messages, params)[0].outputs[0].token_ids
    with torch.no_grad():
        generated = hf_thinker.generate(**ref, do_sample=False, max_new_tokens=STEPS, min_new_tokens=STEPS)
    assert tokens == generated[0, ref["input_ids"].shape[1] :].tolist()
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages


def test_multimodal_requests_batched_equal_each_alone(llm):
    conversations = [CASES[c]() for c in CASES]
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.chat(conversations, params)]
    alone = [llm.chat(c, params)[0].outputs[0].token_ids for c in conversations]
    assert together == alone
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages
