"""The encoders' fused varlen attention on a GPU: equal to the grouped-SDPA reference; clips batched together
match each alone and the float32 CPU encoder."""

import numpy as np
import pytest
import torch

from omnistage.models.layers.varlen_attention import Segments, _grouped_sdpa, varlen_attention
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.audio_encoder import load_audio_encoder

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("heads", "dim", "lengths"), [(20, 64, [104, 104, 37, 104, 12, 1]), (16, 72, [256, 64])]
)
def test_fused_varlen_equals_the_reference(heads, dim, lengths):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(sum(lengths), heads, dim, device="cuda", generator=g, dtype=torch.bfloat16)
        for _ in range(3)
    )
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    segments = Segments.of(bounds, q.device)
    assert segments.device_bounds is not None and segments.max_len == max(lengths)
    got = varlen_attention(q, k, v, segments).float()
    want = _grouped_sdpa(q.float(), k.float(), v.float(), bounds)
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_audio_encoder_batch_invariant_and_close_to_float32(tiny_checkpoint):
    from omnistage.models.qwen3_omni.audio_features import log_mel

    rng = np.random.default_rng(0)
    clips = [(0.3 * rng.standard_normal(round(s * 16000))).astype(np.float32) for s in (0.7, 9.3, 2.2, 8.0)]
    features = [log_mel(c) for c in clips]
    gpu = load_audio_encoder(tiny_checkpoint, LoadOptions(torch.bfloat16, torch.device("cuda")))
    cpu = load_audio_encoder(tiny_checkpoint, LoadOptions(torch.float32, torch.device("cpu")))
    with torch.inference_mode():
        together = gpu([f.cuda() for f in features])
        for f, got in zip(features, together):
            alone = gpu([f.cuda()])[0]  # GEMMs over other token counts may round differently: bf16 noise only
            assert (got - alone).float().abs().max() <= 1e-2 * alone.float().abs().max()
            want = cpu([f])[0]
            assert (got.float().cpu() - want).abs().max() <= 3e-2 * want.abs().max()
