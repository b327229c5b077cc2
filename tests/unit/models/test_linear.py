import torch
from torch import nn

from omnistage.models.layers.linear import fuse_linears, fuse_projections
from omnistage.models.layers.moe import GatedMLP
from omnistage.models.qwen3_omni.code_predictor import CodePredictorAttention
from omnistage.models.qwen3_omni.config import CodePredictorConfig


def test_fused_weight_is_the_stacked_weights_and_they_become_views_of_it():
    torch.manual_seed(0)
    a, b = nn.Linear(8, 3, bias=False), nn.Linear(8, 5, bias=False)
    before = torch.cat([a.weight, b.weight]).detach().clone()
    fused = fuse_linears(a, b)
    assert torch.equal(fused, before)
    assert a.weight.data_ptr() == fused.data_ptr()
    assert b.weight.data_ptr() == fused[3:].data_ptr()
    assert set(dict(a.named_parameters())) == {"weight"}  # the checkpoint's names are kept


def test_gated_mlp_gives_the_same_output_fused():
    torch.manual_seed(0)
    mlp = GatedMLP(16, 24)
    x = torch.randn(5, 16)
    expected = mlp(x)
    fuse_projections(nn.Sequential(mlp))
    assert mlp.gate_up is not None
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-6)


def test_code_predictor_attention_gives_the_same_output_fused():
    torch.manual_seed(0)
    cfg = CodePredictorConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_code_groups=4, vocab_size=16, rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )  # fmt: skip
    attn = CodePredictorAttention(cfg)
    x = torch.randn(2, 3, 32)
    cos, sin = torch.ones(3, 8), torch.zeros(3, 8)
    kv = torch.zeros(2, 2, 2, 4, 8)
    expected = attn(x, cos, sin, kv.clone(), 0, causal=True)
    attn.fuse_projections()
    torch.testing.assert_close(attn(x, cos, sin, kv, 0, causal=True), expected, rtol=1e-5, atol=1e-6)
