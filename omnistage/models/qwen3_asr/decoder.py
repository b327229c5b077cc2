"""Qwen3-ASR's language model: a dense Qwen3 decoder over a flat, ragged batch with paged KV.

The same interface as the Qwen3-Omni Thinker (`forward(input_ids, positions [3, T], kv_caches, meta,
inputs_embeds)`, `compute_logits`), so the engine runs it as it runs the Thinker; the same decoder layers
(`layers.decoder`), with a dense SwiGLU MLP in the experts' place. Audio tokens arrive as
`inputs_embeds` rows at the `<|audio_pad|>` placeholders. Positions are consecutive and equal on all three
M-RoPE streams for an audio-and-text prompt, which makes the released M-RoPE plain RoPE (transformers'
-hf conversion drops the M-RoPE fields for that reason): one rotary section holding every frequency.
"""

from __future__ import annotations

from pathlib import Path

from omnistage.models.layers.attention import PagedSelfAttention
from omnistage.models.layers.attention_backend import AttentionBackend
from omnistage.models.layers.decoder import CausalLM, DecoderLayer, TextDecoder
from omnistage.models.layers.moe import GatedMLP
from omnistage.models.loader import LoadOptions, load_model
from omnistage.models.qwen3_asr.config import DenseTextConfig, Qwen3ASRConfig

# Where each layout keeps the decoder body and the output head.
PREFIXES = {
    "released": ("thinker.model.", "thinker.lm_head."),
    "hf": ("model.language_model.", "lm_head."),
}


def dense_decoder_layer(cfg: DenseTextConfig, backend: AttentionBackend) -> DecoderLayer:
    """Pre-norm attention (q/k norm, RoPE, GQA) then a SwiGLU MLP."""
    return DecoderLayer(
        cfg, PagedSelfAttention(cfg, backend), GatedMLP(cfg.hidden_size, cfg.intermediate_size)
    )


class Qwen3ASRDecoder(CausalLM):
    """The Thinker's interface (`layers.decoder.CausalLM`), so an LLM stage runs it as it runs the Thinker."""

    config: DenseTextConfig

    def __init__(self, cfg: DenseTextConfig, backend: AttentionBackend) -> None:
        plain_rope = (cfg.head_dim // 2, 0, 0)
        super().__init__(cfg, TextDecoder(cfg, lambda: dense_decoder_layer(cfg, backend), plain_rope))

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight


def load_decoder(
    checkpoint_dir: str | Path, options: LoadOptions, backend: AttentionBackend
) -> Qwen3ASRDecoder:
    """The decoder of a Qwen3-ASR checkpoint directory (either layout).

    With tied embeddings the head is the embedding table, as transformers ties them: a head tensor in the
    file (the released files carry one, equal to the table) is not read.
    """
    cfg = Qwen3ASRConfig.from_dir(checkpoint_dir)
    body, head = PREFIXES[cfg.layout]
    tied = cfg.text.tie_word_embeddings
    decoder = load_model(
        lambda: Qwen3ASRDecoder(cfg.text, backend),
        checkpoint_dir,
        lambda decoder: [(decoder.model, body)] + ([] if tied else [(decoder.lm_head, head)]),
        options,
    )
    if tied:
        decoder.tie_weights()
    return decoder
