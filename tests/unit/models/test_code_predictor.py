import json

import pytest
import torch

from omnistage.errors import ConfigError
from omnistage.models.loader import LoadOptions, fill_random_
from omnistage.models.qwen3_omni.code_predictor import CodePredictor, load_code_predictor
from omnistage.models.qwen3_omni.config import CodePredictorConfig
from omnistage.models.qwen3_omni.tiny import tiny_config

CONFIG = CodePredictorConfig(
    vocab_size=40,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=24,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    num_code_groups=5,
)
FRAMES = 3


@pytest.fixture(scope="module")
def predictor() -> CodePredictor:
    model = CodePredictor(CONFIG)
    fill_random_(model, seed=0)
    return model.requires_grad_(False).eval()


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(FRAMES, CONFIG.hidden_size, generator=generator),
        torch.randn(FRAMES, CONFIG.hidden_size, generator=generator),
    )


def test_kv_has_one_slot_per_position_of_a_frame(predictor):
    kv = predictor.new_kv(FRAMES)
    # positions: the talker hidden state, code 0, codes 1..groups-2 (the last code is never fed back)
    assert kv.shape == (2, 2, FRAMES, 2, CONFIG.num_code_groups, 8)


def test_stale_kv_from_an_earlier_frame_is_never_read(predictor):
    hidden, code0 = inputs()
    codes, codec_sum = predictor.predict_frame(hidden, code0)
    stale = torch.full_like(predictor.new_kv(FRAMES), float("nan"))
    again, again_sum = predictor.predict_frame(hidden, code0, kv=stale)
    assert torch.equal(again, codes)
    assert torch.equal(again_sum, codec_sum)
    assert not stale.isnan().any()  # written in place, every slot: G positions are exactly what a frame needs


def test_sampled_ids_feed_the_next_step_and_the_codec_sum(predictor):
    hidden, code0 = inputs(1)
    script = torch.randint(
        0, CONFIG.vocab_size, (CONFIG.num_code_groups - 1, FRAMES), generator=torch.Generator().manual_seed(2)
    )
    seen = []

    def sampler(logits: torch.Tensor) -> torch.Tensor:
        seen.append(logits)
        return script[len(seen) - 1]

    codes, codec_sum = predictor.predict_frame(hidden, code0, sampler)
    assert codes.tolist() == script.T.tolist()
    assert all(s.shape == (FRAMES, CONFIG.vocab_size) and s.dtype == torch.float32 for s in seen)
    # code 0 enters as given (the talker's table); code g >= 1 through the predictor's table g - 1
    expected = code0 + sum(
        predictor.model.codec_embedding[g](script[g]) for g in range(CONFIG.num_code_groups - 1)
    )
    torch.testing.assert_close(codec_sum, expected, rtol=1e-6, atol=1e-6)
    # another id at step 1 leaves step 1's logits alone and changes step 2's
    first = [logits.clone() for logits in seen]
    seen.clear()
    script[0] = (script[0] + 1) % CONFIG.vocab_size
    predictor.predict_frame(hidden, code0, sampler)
    assert torch.equal(seen[0], first[0])
    assert not torch.allclose(seen[1], first[1])


def test_hidden_sizes_of_talker_and_predictor_must_agree(tmp_path):
    config = tiny_config()
    config["talker_config"]["code_predictor_config"]["hidden_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="hidden_size"):
        load_code_predictor(tmp_path, LoadOptions(torch.float32, "cpu", load_format="dummy"))


def test_its_layers_compile_whole_for_every_batch_bucket():
    """On a GPU the layers run under torch.compile: no graph break, and few enough variants over the batch
    buckets that dynamo never falls back to eager (its limit is 8 per code object)."""
    from torch._dynamo.utils import counters

    from omnistage.engine.buckets import decode_buckets
    from omnistage.engine.static_sampling import StaticRows, sample_static

    model = CodePredictor(CONFIG)
    fill_random_(model, seed=0)
    model.requires_grad_(False).eval()
    torch._dynamo.reset()
    counters.clear()
    for layer in model.model.layers:
        layer.compile(dynamic=True, backend="eager")  # the guards are the compiler's, whatever the backend
    buckets = decode_buckets(64)
    kv = model.new_kv(max(buckets))
    try:
        with torch.inference_mode():
            for batch in reversed(buckets):  # as the graphs are captured: largest first
                rows = StaticRows.empty(batch, "cpu")
                hidden, code0 = torch.randn(2, batch, CONFIG.hidden_size)
                model.predict_frame(
                    hidden, code0, lambda logits, rows=rows: sample_static(logits, rows, 5), kv[:, :, :batch]
                )
        assert not counters["graph_break"]
        assert counters["stats"]["unique_graphs"] <= 8
    finally:
        torch._dynamo.reset()
