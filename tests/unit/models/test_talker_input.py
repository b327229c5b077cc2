"""The speech hand-off's rules on hand-made Thinker sequences (tiny checkpoint's Talker, float32, CPU)."""

import pytest
import torch

from omnistage.engine.attention import TorchReferenceBackend
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.mrope import MediaLayout
from omnistage.models.qwen3_omni.talker import load_talker
from omnistage.models.qwen3_omni.talker_input import (
    PromptSource,
    SpeechTokens,
    TtsEmbeds,
    assistant_turn_start,
    step_text,
    talker_positions,
    talker_prompts,
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


@pytest.fixture(scope="module")
def table(setup):
    """A Thinker embedding of random rows over the whole vocabulary and its text rows' table."""
    cfg, _, talker = setup
    generator = torch.Generator().manual_seed(0)
    embedding = torch.nn.Embedding(cfg.thinker.text.vocab_size, talker.config.thinker_hidden_size)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(embedding.weight.shape, generator=generator))
        return embedding, text_rows(talker, embedding)


@torch.no_grad()
def test_prefill_rows_follow_the_layout(setup, table):
    """User rows: hidden_projection at placeholders, text_projection elsewhere; then the 9 assistant rows."""
    cfg, tokens, talker = setup
    embedding, rows = table
    audio = tokens.placeholders[0]
    ids = torch.tensor(
        turn(tokens, 8948, [WORD])
        + turn(tokens, tokens.user, [audio, audio, WORD])
        + turn(tokens, tokens.assistant, [], closed=False)
    )
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, cfg.thinker.text.hidden_size, generator=generator)
    tts = TtsEmbeds(*torch.randn(3, talker.config.text.hidden_size, generator=generator))
    speaker, first = tokens.speaker_id("aiden"), 4000
    (prompt,) = talker_prompts(talker, tokens, tts, rows, [PromptSource(ids, hidden, first, speaker)])

    user = slice(6, 14)  # the user turn: <|im_start|> user \n audio audio word <|im_end|> \n
    assert prompt.embeds.shape == (8 + 9, talker.config.text.hidden_size)
    assert prompt.rope_ids.tolist() == ids[user].tolist() + [tokens.tts_pad] * 9
    text = lambda ids: talker.text_projection(embedding(ids))  # noqa: E731
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prompt.embeds[3:5], talker.hidden_projection(hidden))
    torch.testing.assert_close(prompt.embeds[:3], text(ids[6:9]), **close)
    torch.testing.assert_close(prompt.embeds[5:8], text(ids[11:14]), **close)
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
    torch.testing.assert_close(assistant[:3], text(ids[-3:]), **close)  # the header, without codec
    text_side = torch.cat((torch.stack([tts.pad] * 4 + [tts.bos]), text(torch.tensor([first]))))
    torch.testing.assert_close(assistant[3:], text_side + codec(torch.tensor(codec_ids)), **close)
    # audio only: every position its own index on all three streams, so decode continues at the length
    positions = talker_positions(prompt, cfg, MediaLayout([], [2]))
    assert torch.equal(positions.positions, torch.arange(17).expand(3, -1)) and positions.delta == 0

    with pytest.raises(ValueError, match="must end with the assistant header"):
        talker_prompts(talker, tokens, tts, rows, [PromptSource(ids[:-1], hidden, first, speaker)])


@torch.no_grad()
def test_prompts_built_together_equal_each_built_alone(setup, table, monkeypatch):
    """A hand-off of several requests at once (text only, a clip, clips over two user turns, another voice)
    gives each the rows it gets alone, and reads only the hidden states of user turns' placeholders."""
    cfg, tokens, talker = setup
    _, rows = table
    audio, image = tokens.placeholders[:2]
    generator = torch.Generator().manual_seed(3)
    tts = TtsEmbeds(*torch.randn(3, talker.config.text.hidden_size, generator=generator))
    header = turn(tokens, tokens.assistant, [], closed=False)
    prompts = [
        turn(tokens, 8948, [WORD]) + turn(tokens, tokens.user, [WORD, 2000, 3000]) + header,
        turn(tokens, tokens.user, [audio, audio, audio, WORD]) + header,
        turn(tokens, tokens.user, [image, WORD])
        + turn(tokens, tokens.assistant, [WORD])
        + turn(tokens, tokens.user, [audio, audio, 2000])
        + header,
        turn(tokens, tokens.user, [5000]) + header,
    ]
    sources = []
    for i, ids in enumerate(prompts):
        ids = torch.tensor(ids)
        media = int(torch.isin(ids, torch.tensor(tokens.placeholders)).sum())
        hidden = torch.randn(media, cfg.thinker.text.hidden_size, generator=generator)
        voice = "aiden" if i % 2 else "ethan"
        sources.append(PromptSource(ids, hidden, 100 + i, tokens.speaker_id(voice)))
    copies, projections = [], []
    monkeypatch.setattr(
        "omnistage.models.qwen3_omni.talker_input.to_device_together",
        lambda hosts, device: copies.append(len(hosts)) or [host.to(device) for host in hosts],
    )
    hook = talker.hidden_projection.register_forward_hook(lambda *args: projections.append(args[1][0].shape))
    try:
        together = talker_prompts(talker, tokens, tts, rows, sources)
    finally:
        hook.remove()
    # one copy of the indices and one projection of the media rows read (3 + 1 + 2) for all four prompts
    assert copies == [7] and projections == [(6, cfg.thinker.text.hidden_size)]
    assert len(together) == len(sources)
    for source, got in zip(sources, together, strict=True):
        (alone,) = talker_prompts(talker, tokens, tts, rows, [source])
        assert torch.equal(got.rope_ids, alone.rope_ids)
        torch.testing.assert_close(got.embeds, alone.embeds, rtol=1e-6, atol=1e-6)
    # the third prompt's media rows: the image, then the two clips of its second user turn, in order
    media_rows = together[2].embeds[[3, 10, 11]]
    torch.testing.assert_close(media_rows, talker.hidden_projection(sources[2].media_hidden))
    assert talker_prompts(talker, tokens, tts, rows, []) == []


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
