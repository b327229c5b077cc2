"""The Talker's prefix-cache keys of a speaking request (prefix_keys.py).

The Talker's prompt is every user turn of the conversation, then 9 assistant rows (talker_input.py), and its
user turns take positions from 0 on: a conversation's next turn repeats the last turn's user part as its own
prefix, at the same positions. Keyed, those pages are taken from the Talker's pool instead of prefilled again,
so a turn's Talker prefill is its new user turn and the assistant rows, not the whole conversation.

A user row is `text_projection` of its token's embedding, or `hidden_projection` of the Thinker's hidden state
at a media placeholder. So, as the Thinker's keys hold the encoder rows behind its placeholders, a Talker page's
key chains its ids, its M-RoPE positions and the bytes of those hidden states: the rows' own sources, which are
bit-identical from turn to turn where the Thinker's pages and their kept hidden rows come from its cache
(TokenRunner.keep_taps), whatever batch projected them. Only pages wholly inside the user part are keyed: an
assistant row depends on the voice and on the reply's first token, which the ids do not say.
"""

from __future__ import annotations

import numpy as np
import torch

from omnistage.engine.prefix_keys import MediaRows, PageKeys
from omnistage.models.layers.rotary import PromptPositions
from omnistage.models.qwen3_omni.talker_input import SpeechTokens, user_turn_mask


def talker_keys(
    prompt_ids: list[int],
    tokens: SpeechTokens,
    media_hidden: torch.Tensor,
    positions: PromptPositions,
    page_size: int,
) -> PageKeys:
    """The keys of the full pages of the Talker prompt's user part. `prompt_ids`: the Thinker's prompt;
    `media_hidden` `[M, Ht]` (on the host) the Thinker's hidden states at each of its placeholders in order (as
    talker_input.PromptSource holds them); `positions`: the Talker prompt's."""
    ids = np.asarray(prompt_ids, dtype=np.int64)
    user = user_turn_mask(torch.from_numpy(ids), tokens).numpy()
    placeholder = np.isin(ids, tokens.placeholders)
    user_rows = np.flatnonzero(user)
    media = np.flatnonzero(placeholder[user_rows])  # their rows in the Talker's prompt
    kinds: tuple[MediaRows, ...] = ()
    if len(media):
        read = (np.cumsum(placeholder) - 1)[user_rows[media]]  # those in user turns, among all placeholders
        # every placeholder in a user turn (no media in a system turn): all of them in order, as they are (a
        # 30 s video's are ~90 MB, not copied)
        held = media_hidden if len(read) == len(media_hidden) else media_hidden[torch.from_numpy(read)]
        values = held.contiguous().view(torch.uint8).numpy()
        kinds = (MediaRows(media, values),)
    num_user = len(user_rows)
    return PageKeys.of_prompt(
        ids[user_rows].tolist(),
        page_size,
        positions.positions[:, :num_user].numpy(),
        positions.delta,
        kinds,
        end=num_user // page_size,
    )
