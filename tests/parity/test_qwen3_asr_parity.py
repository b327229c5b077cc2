"""Qwen3-ASR against transformers (float32, CPU): features, encoder, logits, greedy tokens, parsed output.

Three tiny checkpoints: one transformers writes itself (save_pretrained of a randomly initialised
Qwen3ASRForConditionalGeneration, -hf layout), and `make_tiny`'s two layouts of one seed. transformers runs the
-hf ones; we run all three, the released layout standing for its -hf twin. Clips of 1, 7, 9 and 31 s sit on
and across the encoder's 8 s attention windows; each is transcribed with and without a forced language by
transformers' processor and generate, and by our prompt, encoder and decoder in a plain greedy loop over
paged KV.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from transformers import (
    AutoTokenizer,
    Qwen3ASRConfig,
    Qwen3ASRFeatureExtractor,
    Qwen3ASRForConditionalGeneration,
    Qwen3ASRProcessor,
)
from transformers.models.qwen3_asr.processing_qwen3_asr import _parse_single_output

from omnistage.engine.attention import AttentionMetadata, Chunk, TorchReferenceBackend
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_asr.audio_encoder import load_audio_encoder
from omnistage.models.qwen3_asr.audio_features import log_mel
from omnistage.models.qwen3_asr.config import EOS_TOKEN_IDS
from omnistage.models.qwen3_asr.config import Qwen3ASRConfig as OurConfig
from omnistage.models.qwen3_asr.decoder import load_decoder
from omnistage.models.qwen3_asr.output import Transcription, parse_transcription
from omnistage.models.qwen3_asr.processor import ASRProcessor
from omnistage.models.qwen3_asr.prompt import prompt_ids
from omnistage.models.qwen3_asr.tiny import hf_config, make_tiny, tiny_config
from omnistage.models.qwen3_asr.tokenizer import CHAT_TEMPLATE

PAGE = 16
TOLERANCE = 1e-4  # max abs error relative to the reference's max abs
MEL_TOLERANCE = 1e-4  # max abs, features are O(1)
NEW_TOKENS = 8
SECONDS = (1.0, 7.0, 9.0, 31.0)


def clip(seconds: float, seed: int = 0) -> np.ndarray:
    n = int(seconds * 16000)
    t = np.arange(n) / 16000
    noise = np.random.default_rng(seed).standard_normal(n)
    return (0.4 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1730 * t) + 0.05 * noise).astype(
        np.float32
    )


def hf_features(seconds: float) -> dict:
    """transformers' extractor called as its processor calls it."""
    kwargs = {"padding": True, "truncation": False, "return_attention_mask": True}
    return Qwen3ASRFeatureExtractor()(clip(seconds), sampling_rate=16000, **kwargs)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """{name: (our checkpoint dir, transformers' model on the same weights)}."""
    made_hf = make_tiny(tmp_path_factory.mktemp("asr-hf"), layout="hf")
    made_released = make_tiny(tmp_path_factory.mktemp("asr-released"), layout="released")
    twin = Qwen3ASRForConditionalGeneration.from_pretrained(made_hf, dtype=torch.float32).eval()
    torch.manual_seed(0)
    own = Qwen3ASRForConditionalGeneration(Qwen3ASRConfig(**hf_config(tiny_config()))).eval()
    own_dir = tmp_path_factory.mktemp("asr-transformers")
    own.save_pretrained(own_dir)
    return {
        "make-tiny hf": (made_hf, twin),
        "make-tiny released": (made_released, twin),
        "transformers": (own_dir, own),
    }


@pytest.fixture(scope="module")
def processor(checkpoints) -> Qwen3ASRProcessor:
    tokenizer_dir = checkpoints["make-tiny hf"][0]
    return Qwen3ASRProcessor(
        feature_extractor=Qwen3ASRFeatureExtractor(),
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
        chat_template=CHAT_TEMPLATE,
    )


@pytest.fixture(scope="module")
def ours(checkpoints) -> dict:
    backend = TorchReferenceBackend()
    return {
        name: {
            "cfg": OurConfig.from_dir(directory),
            "encoder": load_audio_encoder(directory, LoadOptions(torch.float32, "cpu")),
            "decoder": load_decoder(directory, LoadOptions(torch.float32, "cpu"), backend),
        }
        for name, (directory, _) in checkpoints.items()
    }


@pytest.fixture(scope="module")
def tokenizer(checkpoints) -> Tokenizer:
    return Tokenizer.from_file(str(checkpoints["make-tiny released"][0] / "tokenizer.json"))


class PagedSequence:
    """One sequence's paged KV over the decoder's layers, fed chunk by chunk."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, max_len: int) -> None:
        pages = math.ceil(max_len / PAGE)
        self.kv_caches = [torch.zeros(2, pages, PAGE, kv_heads, head_dim) for _ in range(num_layers)]
        self.pages = list(range(pages))
        self.length = 0

    def step(self, new: int) -> tuple[torch.Tensor, AttentionMetadata]:
        positions = torch.arange(self.length, self.length + new).expand(3, -1)
        chunk = Chunk(self.length, new, self.pages[: math.ceil((self.length + new) / PAGE)])
        self.length += new
        return positions, AttentionMetadata.build([chunk], PAGE)


@torch.no_grad()
def our_greedy(
    model: dict, ids: list[int], features: torch.Tensor, steps: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy reply ids (stopping at EOS) and the prompt's logits `[P, vocab]`."""
    cfg, decoder = model["cfg"], model["decoder"]
    ids_t = torch.tensor(ids)
    embeds = decoder.model.embed_tokens(ids_t)
    embeds[ids_t == cfg.audio_token_id] = model["encoder"]([features])[0]
    text = cfg.text
    seq = PagedSequence(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, len(ids) + steps)
    positions, meta = seq.step(len(ids))
    prompt_logits = decoder.compute_logits(
        decoder(ids_t, positions, seq.kv_caches, meta, inputs_embeds=embeds)
    )
    reply = [int(prompt_logits[-1].argmax())]
    while len(reply) < steps and reply[-1] not in EOS_TOKEN_IDS:
        positions, meta = seq.step(1)
        hidden = decoder(torch.tensor(reply[-1:]), positions, seq.kv_caches, meta)
        reply.append(int(decoder.compute_logits(hidden)[-1].argmax()))
    return reply, prompt_logits


def test_features_match_transformers_extractor():
    for seconds in (0.2, 1.0, 7.3):
        out = hf_features(seconds)
        valid = int(out["attention_mask"].sum())
        ref = out["input_features"][0, :, :valid]
        ours = log_mel(clip(seconds))
        assert ours.shape == ref.shape, seconds
        assert (ours - ref).abs().max().item() <= MEL_TOLERANCE, seconds


def test_processor_hands_the_clip_padded_to_half_a_second(tmp_path):
    """The processor hands the engine the waveform its features are made of (the encoder stage makes them,
    `log_mels`): float32, zero-padded to 0.5 s, as many frames as the placeholders count."""
    processor = ASRProcessor(make_tiny(tmp_path / "asr"))
    for seconds in (0.2, 7.3):
        prompt = processor.transcription(clip(seconds), "en", None)
        (waveform,) = prompt.mm.audio_clips
        assert waveform.dtype == torch.float32 and waveform.numel() == max(8000, len(clip(seconds)))
        assert torch.equal(waveform[: len(clip(seconds))], torch.from_numpy(clip(seconds)))
        assert not waveform[len(clip(seconds)) :].any()
        assert torch.equal(log_mel(waveform.numpy()), log_mel(clip(seconds)))
        frames = log_mel(clip(seconds)).shape[-1]
        assert prompt.token_ids == prompt_ids(processor.tokenizer, processor.cfg, frames, language="English")


def test_released_and_hf_layouts_load_the_same_weights(ours):
    released, hf = ours["make-tiny released"], ours["make-tiny hf"]
    for part in ("encoder", "decoder"):
        a, b = released[part].state_dict(), hf[part].state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), part


@pytest.mark.parametrize("name", ["make-tiny released", "transformers"])
def test_encoder_matches_transformers(checkpoints, ours, name):
    hf = checkpoints[name][1]
    for seconds in (0.3, 1.0, 1.5, 9.0):
        out = hf_features(seconds)
        with torch.no_grad():
            ref = hf.model.get_audio_features(out["input_features"], out["attention_mask"]).pooler_output
            mine = ours[name]["encoder"]([log_mel(clip(seconds))])[0]
        assert mine.shape == ref.shape
        assert relative_error(mine, ref) <= TOLERANCE, (name, seconds)


@pytest.mark.parametrize("name", ["make-tiny released", "make-tiny hf", "transformers"])
@pytest.mark.parametrize("language", [None, "English"])
def test_greedy_transcription_matches_generate(checkpoints, ours, processor, tokenizer, name, language):
    """Prompt ids, prompt logits and greedy reply equal transformers' for each clip; parsed replies agree."""
    hf = checkpoints[name][1]
    model = ours[name]
    for seconds in SECONDS:
        inputs = processor.apply_transcription_request(clip(seconds), language=language)
        features = log_mel(clip(seconds))
        ids = prompt_ids(tokenizer, model["cfg"], features.shape[-1], language=language)
        assert ids == inputs["input_ids"][0].tolist(), seconds
        with torch.no_grad():
            ref_logits = hf(**inputs).logits[0]
            generated = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        ref_reply = generated[0, len(ids) :].tolist()
        reply, logits = our_greedy(model, ids, features, NEW_TOKENS)
        assert relative_error(logits, ref_logits) <= TOLERANCE, seconds
        assert reply == ref_reply, seconds
        decoded = tokenizer.decode(reply, skip_special_tokens=True)
        parsed = processor.decode(generated[0, len(ids) :], return_format="parsed")
        assert parse_transcription(decoded) == _as_transcription(parsed)


def _as_transcription(parsed: dict) -> Transcription:
    return Transcription(parsed["language"], parsed["transcription"])


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "   ",
        "language English<asr_text>Hello there.",
        "language None<asr_text>",
        "language none<asr_text>  ",
        "language Chinese\n<asr_text>你好",
        "\nlanguage  German  \nmore<asr_text> Guten Tag ",
        "English<asr_text>no prefix word",
        "language <asr_text>empty name",
        "just text without a marker",
        "system\nx\nuser\n\nassistant\nlanguage French<asr_text>Bonjour",
        "language English<asr_text>" + "ha" * 30 + " end",
        "language English<asr_text>" + "a" * 25 + "b" * 20 + "c" * 40,
        "x" * 20 + "language English<asr_text>" + "abc" * 21,
        "language English<asr_text>" + "the cat " * 25,
        "language English<asr_text>one <asr_text> two",
    ],
)
def test_parser_matches_transformers(raw):
    ref = _parse_single_output(raw)
    assert parse_transcription(raw) == _as_transcription(ref)


@pytest.mark.parametrize("language", [None, "en"])
def test_the_served_pipeline_transcribes_as_generate(checkpoints, processor, language):
    """Through the engine (`LLM`, paged KV, the encoder stage making all the clips' features at once, batched
    prefill of all clips at once) the greedy
    replies equal transformers' generate, and the processor reads them as transformers' parser does."""
    from omnistage import LLM, SamplingParams
    from omnistage.engine.stages.text_setup import NewRequest

    directory, hf = checkpoints["make-tiny released"]
    llm = LLM(str(directory), device="cpu", dtype="float32", page_size=PAGE)
    ours = llm.pipeline.processor
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    prompts = [ours.transcription(clip(seconds), language, None) for seconds in SECONDS]
    assert all(p.mm.audio_clips[0].dim() == 1 for p in prompts)  # waveforms: the stage makes the features
    requests = [
        NewRequest(str(i), p.token_ids, params, p.prompt, p.mrope, p.mm) for i, p in enumerate(prompts)
    ]
    outputs = llm._run(llm._admit(requests))
    for seconds, prompt, out in zip(SECONDS, prompts, outputs):
        inputs = processor.apply_transcription_request(
            clip(seconds), language="English" if language else None
        )
        assert prompt.token_ids == inputs["input_ids"][0].tolist(), seconds
        with torch.no_grad():
            generated = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(prompt.token_ids) :
            ]
        reply = out.outputs[0].token_ids
        assert reply == generated.tolist()[: len(reply)] and len(reply) in (NEW_TOKENS, len(generated)), (
            seconds
        )
        parsed = processor.decode(generated, return_format="parsed")
        language_read, text = ours.transcript(out.outputs[0].text)
        assert (language_read, text) == (parsed.get("language") or None, parsed.get("transcription", "")), (
            seconds
        )
