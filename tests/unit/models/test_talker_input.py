"""The speech hand-off's rules on hand-made Thinker sequences (tiny checkpoint's Talker, float32, CPU)."""

import pytest
import torch

from omnistage.engine.attention import TorchReferenceBackend
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.mrope import MediaLayout
from omnistage.models.qwen3_omni.talker import load_talker
from omnistage.models.qwen3_omni.talker_input import (
    SpeechTokens,
    TtsEmbeds,
    assistant_turn_start,
    step_text,
    talker_positions,
    talker_prompt,
    text_rows,
    trailing_text,
    user_turn_mask,
)

NEWLINE, WORD, IM_END = 198, 1000, 151645


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    cfg = Qwen3OmniConfig.from_dir(tiny_checkpoint)
    talker = load_talker(tiny_checkpoint, LoadOptions(torch.float32, "cpu"), TorchReferenceBackend())
    return cfg, SpeechTokens.from_config(cfg), talker


def turn(tokens: SpeechTokens, role: int, body: list[int], closed: bool = True) -> list[int]:
    return [tokens.im_start, role, NEWLINE, *body, *([IM_END, NEWLINE] if closed else [])]


def test_user_turns_and_the_spoken_assistant_turn(setup):
    _, tokens, _ = setup
    system = 8948
    audio = tokens.placeholders[0]
    ids = (
        [WORD]  # before any turn: belongs to none
        + turn(tokens, system, [WORD, WORD])
        + turn(tokens, tokens.user, [audio, audio, WORD])
        + turn(tokens, tokens.assistant, [WORD])
        + turn(tokens, tokens.user, [WORD])
        + turn(tokens, tokens.assistant, [], closed=False)
    )
    mask = user_turn_mask(torch.tensor(ids), tokens)
    expected = [False] * 8 + [True] * 8 + [False] * 6 + [True] * 6 + [False] * 3
    assert mask.tolist() == expected
    assert assistant_turn_start(torch.tensor(ids), tokens) == len(ids) - 3
    with pytest.raises(ValueError, match="no assistant turn"):
        assistant_turn_start(torch.tensor(turn(tokens, tokens.user, [WORD])), tokens)


def test_speaker_ids_are_case_insensitive(setup):
    cfg, tokens, _ = setup
    assert tokens.speaker_id("Ethan") == cfg.talker.speaker_id["ethan"]
    with pytest.raises(ValueError, match="unknown voice 'nobody'"):
        tokens.speaker_id("nobody")


@torch.no_grad()
def test_prefill_rows_follow_the_layout(setup):
    """User rows: hidden_projection at placeholders, text_projection elsewhere; then the 9 assistant rows."""
    cfg, tokens, talker = setup
    audio = tokens.placeholders[0]
    ids = torch.tensor(
        turn(tokens, 8948, [WORD])
        + turn(tokens, tokens.user, [audio, audio, WORD])
        + turn(tokens, tokens.assistant, [], closed=False)
    )
    generator = torch.Generator().manual_seed(0)
    width = cfg.thinker.text.hidden_size
    embeds, hidden = (torch.randn(len(ids), width, generator=generator) for _ in range(2))
    first_text = torch.randn(width, generator=generator)
    tts = TtsEmbeds(*torch.randn(3, talker.config.text.hidden_size, generator=generator))
    speaker = tokens.speaker_id("aiden")
    prompt = talker_prompt(talker, tokens, tts, ids, embeds, hidden, first_text, speaker)

    user = slice(6, 14)  # the user turn: <|im_start|> user \n audio audio word <|im_end|> \n
    assert prompt.embeds.shape == (8 + 9, talker.config.text.hidden_size)
    assert prompt.rope_ids.tolist() == ids[user].tolist() + [tokens.tts_pad] * 9
    text, media = talker.text_projection, talker.hidden_projection
    torch.testing.assert_close(prompt.embeds[3:5], media(hidden[9:11]))
    torch.testing.assert_close(prompt.embeds[:3], text(embeds[6:9]))
    torch.testing.assert_close(prompt.embeds[5:8], text(embeds[11:14]))
    codec = talker.model.codec_embedding
    codec_ids = [
        tokens.codec_nothink,
        tokens.codec_think_bos,
        tokens.codec_think_eos,
        speaker,
        tokens.codec_pad,
        tokens.codec_bos,
    ]
    assistant = prompt.embeds[8:]
    torch.testing.assert_close(assistant[:3], text(embeds[-3:]))  # the header, without codec
    text_side = torch.stack([tts.pad] * 4 + [tts.bos, text(first_text)])
    torch.testing.assert_close(assistant[3:], text_side + codec(torch.tensor(codec_ids)))
    # audio only: every position its own index on all three streams, so decode continues at the length
    positions = talker_positions(prompt, cfg, MediaLayout([], [2]))
    assert torch.equal(positions.positions, torch.arange(17).expand(3, -1)) and positions.delta == 0

    with pytest.raises(ValueError, match="must end with the assistant header"):
        talker_prompt(talker, tokens, tts, ids[:-1], embeds[:-1], hidden[:-1], first_text, speaker)


@torch.no_grad()
def test_trailing_text_then_eos_then_pad(setup):
    _, _, talker = setup
    generator = torch.Generator().manual_seed(1)
    tts = TtsEmbeds(*torch.randn(3, talker.config.text.hidden_size, generator=generator))
    later = torch.randn(2, talker.config.thinker_hidden_size, generator=generator)
    trailing = trailing_text(talker, tts, later)
    steps = [step_text(trailing, step, tts) for step in range(5)]
    projected = talker.text_projection(later)
    for got, expected in zip(steps, [projected[0], projected[1], tts.eos, tts.pad, tts.pad], strict=True):
        torch.testing.assert_close(got, expected)


@torch.no_grad()
def test_text_rows_are_each_tokens_projected_embedding(setup, monkeypatch):
    _, _, talker = setup
    generator = torch.Generator().manual_seed(2)
    embedding = torch.nn.Embedding(37, talker.config.thinker_hidden_size)
    embedding.weight.copy_(torch.randn(embedding.weight.shape, generator=generator))
    # several calls of a few rows each, the last one short: the table is whole and in order
    monkeypatch.setattr("omnistage.models.qwen3_omni.talker_input.TEXT_ROWS_PER_CALL", 8)
    table = text_rows(talker, embedding)
    assert table.shape == (37, talker.config.text.hidden_size)
    ids = torch.tensor([0, 5, 8, 31, 36])
    torch.testing.assert_close(table[ids], talker.text_projection(embedding(ids)), rtol=1e-6, atol=1e-6)
