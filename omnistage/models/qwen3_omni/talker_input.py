"""The Talker's input, built from what the Thinker read and wrote (the speech hand-off).

The rules of transformers' `Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)`, as pure tensor
functions over a single sequence:

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

from dataclasses import dataclass

import torch

from omnistage.models.layers.rotary import PromptPositions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.mrope import MediaLayout
from omnistage.models.qwen3_omni.talker import Talker

ASSISTANT_HEADER_ROWS = 3  # <|im_start|> assistant \n


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


def talker_prompt(
    talker: Talker,
    tokens: SpeechTokens,
    tts: TtsEmbeds,
    prompt_ids: torch.Tensor,
    prompt_embeds: torch.Tensor,
    accept_hidden: torch.Tensor,
    first_text_embed: torch.Tensor,
    speaker_id: int,
) -> TalkerPrompt:
    """The Talker's prefill rows and their rope ids.

    `prompt_ids` `[P]` is the Thinker's expanded prompt, ending in the assistant header; `prompt_embeds`
    `[P, Ht]` its token embeddings (placeholder rows are not read); `accept_hidden` `[P, Ht]` the Thinker's
    hidden states after `accept_hidden_layer` layers (only placeholder rows are read, so a text prompt may pass
    any tensor of that shape); `first_text_embed` `[Ht]` the token embedding of the reply's first token, which
    is all the Talker needs of the reply to start.
    """
    start = assistant_turn_start(prompt_ids, tokens)
    if start + ASSISTANT_HEADER_ROWS != len(prompt_ids):
        raise ValueError("the prompt must end with the assistant header `<|im_start|>assistant\\n`")
    user = user_turn_mask(prompt_ids, tokens)
    media = torch.isin(prompt_ids, torch.tensor(tokens.placeholders, device=prompt_ids.device))
    width = talker.config.text.hidden_size
    user_rows = prompt_embeds.new_empty(int(user.sum()), width)
    media_in_user = media[user]
    user_rows[media_in_user] = talker.hidden_projection(accept_hidden[user & media])
    user_rows[~media_in_user] = talker.text_projection(prompt_embeds[user & ~media])

    projected = talker.text_projection(torch.cat((prompt_embeds[start:], first_text_embed[None])))
    header, first_text = projected[:ASSISTANT_HEADER_ROWS], projected[ASSISTANT_HEADER_ROWS:]
    # tts_pad over nothink, think_bos, think_eos and the speaker; tts_bos over codec_pad; text over codec_bos
    text_side = torch.cat((header, tts.pad.expand(4, -1), tts.bos[None], first_text))
    codec_ids = torch.tensor(
        [
            tokens.codec_nothink,
            tokens.codec_think_bos,
            tokens.codec_think_eos,
            speaker_id,
            tokens.codec_pad,
            tokens.codec_bos,
        ],
        device=prompt_ids.device,
    )
    codec_side = torch.cat(
        (text_side.new_zeros(ASSISTANT_HEADER_ROWS, width), talker.model.codec_embedding(codec_ids))
    )
    assistant_rows = text_side + codec_side
    rope_ids = torch.cat((prompt_ids[user], prompt_ids.new_full((len(assistant_rows),), tokens.tts_pad)))
    return TalkerPrompt(torch.cat((user_rows, assistant_rows)), rope_ids)


def talker_positions(
    prompt: TalkerPrompt,
    cfg: Qwen3OmniConfig,
    media: MediaLayout,
) -> PromptPositions:
    """M-RoPE positions `[3, L]` of the Talker's prompt and the delta its decode steps add to the cache length;
    the media are those of the user turns, in order (the Thinker's prompt keeps no media elsewhere)."""
    return media.positions(prompt.rope_ids.tolist(), cfg.thinker)


def trailing_text(talker: Talker, tts: TtsEmbeds, later_text_embeds: torch.Tensor) -> torch.Tensor:
    """`[K + 1, H]`: what the Talker's decode steps 0..K add to their codec sum once the reply is complete:
    `text_projection` of the spoken tokens after the first (`later_text_embeds` `[K, Ht]`), then tts_eos."""
    return torch.cat((talker.text_projection(later_text_embeds), tts.eos[None]))


def step_text(trailing: torch.Tensor, step: int, tts: TtsEmbeds) -> torch.Tensor:
    """`[H]`: the text part of decode step `step`'s input; tts_pad once the trailing rows are used up."""
    return trailing[step] if step < len(trailing) else tts.pad
