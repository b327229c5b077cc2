"""The Talker's input, built from what the Thinker read and wrote (the speech hand-off).

The rules of transformers' `Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)`, as pure tensor
functions over a single sequence (the prompts over any number of them at once, as a step's hand-off starts them):

- The Talker's prompt is the user turns, then 9 assistant rows. System turns and earlier assistant turns are
  dropped: the Talker voices the reply, and only the request (what is being answered) conditions it.
- User rows: `hidden_projection` of the Thinker's layer-`accept_hidden_layer` hidden state at audio/image/video
  placeholders (a placeholder's token embedding is the encoder's feature, which the Thinker's middle layers
  have already read in context), `text_projection` of the Thinker's token embedding everywhere else.
- Assistant rows (text side + codec side): the header `<|im_start|>assistant\\n` as text with no codec; then
  tts_pad over codec nothink, think_bos, think_eos and the speaker id; tts_bos over codec_pad; the first text
  token over codec_bos, which asks for frame 0. The fixed rows are the trained prompt format.
- Trailing text: one `text_projection` row per Talker step after the prefill (text token 2, 3, ...), then
  tts_eos once, then tts_pad: the Talker reads the text one token per frame and learns from tts_eos that it
  is done.
- Spoken text: the reply's tokens except the Thinker's last one (its EOS, or the token at its length cap), the
  one token the Thinker never feeds back to itself, so transformers has no row for it.
- M-RoPE: the positions of the Talker's own ids (the user turns' Thinker ids, then tts_pad for the 9 assistant
  rows), so they restart at 0 with the system turn gone; a decode step sits at cache length + delta on all
  three streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnistage.models.layers.attention_metadata import to_device_together
from omnistage.models.layers.rotary import PromptPositions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.mrope import MediaLayout
from omnistage.models.qwen3_omni.talker import Talker

ASSISTANT_HEADER_ROWS = 3  # <|im_start|> assistant \n
ASSISTANT_ROWS = 9  # the header, then tts_pad x 4, tts_bos and the first text token over their codec ids
CODEC_ROWS = ASSISTANT_ROWS - ASSISTANT_HEADER_ROWS


@dataclass(frozen=True)
class SpeechTokens:
    """The Thinker token ids and codec ids the hand-off reads or places."""

    im_start: int
    user: int
    assistant: int
    placeholders: tuple[int, ...]  # audio, image, video
    tts_bos: int
    tts_eos: int
    tts_pad: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    codec_pad: int
    codec_bos: int
    speakers: dict[str, int]

    @classmethod
    def from_config(cls, cfg: Qwen3OmniConfig) -> SpeechTokens:
        talker, thinker = cfg.talker, cfg.thinker
        return cls(
            im_start=cfg.im_start_token_id,
            user=cfg.user_token_id,
            assistant=cfg.assistant_token_id,
            placeholders=(thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id),
            tts_bos=cfg.tts_bos_token_id,
            tts_eos=cfg.tts_eos_token_id,
            tts_pad=cfg.tts_pad_token_id,
            codec_nothink=talker.codec_nothink_id,
            codec_think_bos=talker.codec_think_bos_id,
            codec_think_eos=talker.codec_think_eos_id,
            codec_pad=talker.codec_pad_id,
            codec_bos=talker.codec_bos_id,
            speakers=dict(talker.speaker_id),
        )

    def speaker_id(self, voice: str) -> int:
        """The codec id of a released voice, case-insensitively (transformers lower-cases the name)."""
        try:
            return self.speakers[voice.lower()]
        except KeyError:
            raise ValueError(
                f"unknown voice {voice!r}; this checkpoint has {sorted(self.speakers)}"
            ) from None


@dataclass(frozen=True)
class TtsEmbeds:
    """tts_bos, tts_eos and tts_pad `[H]` each, in the Talker's width."""

    bos: torch.Tensor
    eos: torch.Tensor
    pad: torch.Tensor


@dataclass(frozen=True)
class TalkerPrompt:
    embeds: torch.Tensor  # [L, H] the Talker's prefill rows
    rope_ids: torch.Tensor  # [L] the ids its M-RoPE positions are computed from


def tts_embeds(talker: Talker, thinker_embedding: torch.nn.Embedding, tokens: SpeechTokens) -> TtsEmbeds:
    """The tts markers are Thinker vocabulary: their token embeddings through `text_projection`."""
    ids = torch.tensor(
        [tokens.tts_bos, tokens.tts_eos, tokens.tts_pad], device=thinker_embedding.weight.device
    )
    bos, eos, pad = talker.text_projection(thinker_embedding(ids).to(talker.codec_head.weight.device))
    return TtsEmbeds(bos, eos, pad)


TEXT_ROWS_PER_CALL = 16384  # tokens projected per call while building the table: bounds its scratch


def text_rows(talker: Talker, thinker_embedding: torch.nn.Embedding) -> torch.Tensor:
    """`[vocab, H]`: every Thinker token's embedding through `text_projection`, on the Talker's device.

    A Talker step after the prefill reads one such row per speaking request (the next text token's). The
    projection is a pure function of the token, so a lookup in this table replaces the embedding and the
    projection's eager kernels in every step (at the released sizes 151,936 x 1,024 bf16: 297 MiB, planned as
    the speech stages' resident memory)."""
    device = talker.codec_head.weight.device
    weight = thinker_embedding.weight
    table = torch.empty(weight.shape[0], talker.config.text.hidden_size, dtype=weight.dtype, device=device)
    for start in range(0, weight.shape[0], TEXT_ROWS_PER_CALL):
        rows = weight[start : start + TEXT_ROWS_PER_CALL].to(device)
        table[start : start + rows.shape[0]] = talker.text_projection(rows)
    return table


def user_turn_mask(prompt_ids: torch.Tensor, tokens: SpeechTokens) -> torch.Tensor:
    """`[P]` bool: the tokens of user turns, each token belonging to the turn its last `<|im_start|>` opened
    (that marker, the role, the content, `<|im_end|>` and the newline after it). Tokens before the first
    `<|im_start|>` belong to no turn (the chat template never writes any)."""
    index = torch.arange(len(prompt_ids), device=prompt_ids.device)
    opened = torch.where(prompt_ids == tokens.im_start, index, -1).cummax(dim=0).values
    role = prompt_ids[(opened + 1).clamp(max=len(prompt_ids) - 1)]
    return (opened >= 0) & (role == tokens.user)


def assistant_turn_start(prompt_ids: torch.Tensor, tokens: SpeechTokens) -> int:
    """Index of the last `<|im_start|>assistant` in the prompt: the turn being spoken."""
    starts = ((prompt_ids[:-1] == tokens.im_start) & (prompt_ids[1:] == tokens.assistant)).nonzero()
    if len(starts) == 0:
        raise ValueError("the prompt opens no assistant turn to speak")
    return int(starts[-1])


@dataclass(frozen=True)
class PromptSource:
    """What one Talker prompt is built from, all known once the reply's first token is: the Thinker's prompt
    `ids` `[P]` (on the host, ending in the assistant header), the Thinker's hidden states after
    `accept_hidden_layer` layers at each of its media placeholders in order (`media_hidden` `[M, Ht]`, any
    device), the reply's first token and the voice's codec id."""

    ids: torch.Tensor
    media_hidden: torch.Tensor
    first_token: int
    speaker_id: int


def talker_prompts(
    talker: Talker,
    tokens: SpeechTokens,
    tts: TtsEmbeds,
    table: torch.Tensor,
    sources: Sequence[PromptSource],
) -> list[TalkerPrompt]:
    """The Talker's prefill rows and their rope ids, for each of `sources`.

    A text row is `table`'s (`text_rows`: `text_projection` of every token's embedding, on the Talker's
    device), a media row `hidden_projection` of its hidden state. The prompts' layout is planned on the host
    from their ids, and their rows are gathered in one pass of a dozen calls whatever their number: a hand-off
    of many requests at once (a burst's first tokens) neither launches per request nor waits on the device.
    """
    if not sources:
        return []
    device, width = table.device, talker.config.text.hidden_size
    placeholders = torch.tensor(tokens.placeholders)
    table_ids: list[torch.Tensor] = []  # the Thinker tokens whose text rows are read, every prompt's in turn
    media_parts: list[torch.Tensor] = []  # the placeholders' hidden states, every prompt's in turn
    media_picks: list[torch.Tensor] = []  # the placeholders read (those in user turns), in media_parts' rows
    # per prompt, each user row's source: text row k, or media row -1 - k
    user_rows: list[torch.Tensor] = []
    rope_ids: list[torch.Tensor] = []
    headers: list[int] = []  # where each prompt's header rows are among the text rows
    num_text = num_media = num_picked = 0
    for source in sources:
        ids = source.ids
        start = assistant_turn_start(ids, tokens)
        if start + ASSISTANT_HEADER_ROWS != len(ids):
            raise ValueError("the prompt must end with the assistant header `<|im_start|>assistant\\n`")
        user = user_turn_mask(ids, tokens)
        media = torch.isin(ids, placeholders)
        text_ids = ids[user & ~media]
        picked = (media.cumsum(0) - 1)[user & media]
        rows = torch.empty(int(user.sum()), dtype=torch.int64)
        media_in_user = media[user]
        rows[~media_in_user] = torch.arange(num_text, num_text + len(text_ids))
        rows[media_in_user] = -1 - torch.arange(num_picked, num_picked + len(picked))
        # the header's 3 text rows, then the first token's
        table_ids += [text_ids, ids[start:], torch.tensor([source.first_token])]
        headers.append(num_text + len(text_ids))
        num_text += len(text_ids) + ASSISTANT_HEADER_ROWS + 1
        media_parts.append(source.media_hidden.to(device))
        media_picks.append(picked + num_media)
        num_media += len(source.media_hidden)
        num_picked += len(picked)
        user_rows.append(rows)
        rope_ids.append(torch.cat((ids[user], ids.new_full((ASSISTANT_ROWS,), tokens.tts_pad))))
    # the bank of rows the prompts read: text rows, media rows, tts_pad, tts_bos
    pad, bos = num_text + num_picked, num_text + num_picked + 1
    assistant_text: list[torch.Tensor] = []  # each assistant row's text side, in the bank
    codec_rows: list[torch.Tensor] = []  # and its codec side, in the codec rows (0: none)
    codec_ids: list[int] = []
    order: list[torch.Tensor] = []  # each prompt's user rows, then its assistant rows, among all of them
    total_user = sum(len(rows) for rows in user_rows)
    user_at = 0
    for i, (source, rows, header) in enumerate(zip(sources, user_rows, headers, strict=True)):
        assistant_text.append(
            torch.tensor([header, header + 1, header + 2, pad, pad, pad, pad, bos, header + 3])
        )
        # codec rows: none under the header, then nothink, think_bos, think_eos, speaker, pad, bos
        first_codec = 1 + CODEC_ROWS * i
        codec_rows.append(
            torch.tensor([0] * ASSISTANT_HEADER_ROWS + [*range(first_codec, first_codec + CODEC_ROWS)])
        )
        codec_ids += [
            tokens.codec_nothink,
            tokens.codec_think_bos,
            tokens.codec_think_eos,
            source.speaker_id,
            tokens.codec_pad,
            tokens.codec_bos,
        ]
        assistant_at = total_user + ASSISTANT_ROWS * i
        order += [
            torch.arange(user_at, user_at + len(rows)),
            torch.arange(assistant_at, assistant_at + ASSISTANT_ROWS),
        ]
        user_at += len(rows)
    user_index = torch.cat(user_rows)
    user_index = torch.where(user_index < 0, num_text - 1 - user_index, user_index)
    (table_index, pick_index, user_index, text_index, codec_index, codec_ids_device, order_index) = (
        to_device_together(
            [
                torch.cat(table_ids),
                torch.cat(media_picks),
                user_index,
                torch.cat(assistant_text),
                torch.cat(codec_rows),
                torch.tensor(codec_ids),
                torch.cat(order),
            ],
            device,
        )
    )
    parts = [table.index_select(0, table_index)]
    if num_picked:
        parts.append(talker.hidden_projection(torch.cat(media_parts).index_select(0, pick_index)))
    bank = torch.cat((*parts, tts.pad[None], tts.bos[None]))
    codec = talker.model.codec_embedding(codec_ids_device)
    codec = torch.cat((codec.new_zeros(1, width), codec))
    assistant = bank.index_select(0, text_index) + codec.index_select(0, codec_index)
    embeds = torch.cat((bank.index_select(0, user_index), assistant)).index_select(0, order_index)
    lengths = [len(ids) for ids in rope_ids]
    return [TalkerPrompt(rows, ids) for rows, ids in zip(embeds.split(lengths), rope_ids, strict=True)]


def talker_positions(
    prompt: TalkerPrompt,
    cfg: Qwen3OmniConfig,
    media: MediaLayout,
) -> PromptPositions:
    """M-RoPE positions `[3, L]` of the Talker's prompt and the delta its decode steps add to the cache length;
    the media are those of the user turns, in order (the Thinker's prompt keeps no media elsewhere)."""
    return media.positions(prompt.rope_ids, cfg.thinker)


def trailing_text(talker: Talker, tts: TtsEmbeds, later_text_embeds: torch.Tensor) -> torch.Tensor:
    """`[K + 1, H]`: what the Talker's decode steps 0..K add to their codec sum once the reply is complete:
    `text_projection` of the spoken tokens after the first (`later_text_embeds` `[K, Ht]`), then tts_eos."""
    return torch.cat((talker.text_projection(later_text_embeds), tts.eos[None]))


def step_text(trailing: torch.Tensor, step: int, tts: TtsEmbeds) -> torch.Tensor:
    """`[H]`: the text part of decode step `step`'s input; tts_pad once the trailing rows are used up."""
    return trailing[step] if step < len(trailing) else tts.pad
