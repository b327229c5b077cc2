"""Our code predictor (static per-frame KV) against transformers' on the same weights, float32 on the CPU.

The oracle for codes and the codec sum is the talker's own call path: transformers' talker runs the code
predictor's `generate` inside `prepare_inputs_for_generation` and sums the 16 code embeddings there into its
next input. Logits of every inner step within 1e-4 of max |logit|; greedy codes identical; sums within 1e-5.
"""

import pytest
import torch
from transformers.cache_utils import DynamicCache

from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.code_predictor import CodePredictor, greedy, load_code_predictor
from omnistage.models.qwen3_omni.tiny import tiny_config, write_weights

LOGITS_TOLERANCE = 1e-4
SUM_TOLERANCE = 1e-5
FRAMES = 6


def variant_config() -> dict:
    """Three layers, GQA 4:2 with heads wider than hidden/heads, another RoPE base, 8 code groups."""
    config = tiny_config()
    talker = config["talker_config"]
    talker["num_code_groups"] = 8
    talker["code_predictor_config"].update(
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        intermediate_size=48,
        num_code_groups=8,
        layer_types=["full_attention"] * 3,
    )
    talker["code_predictor_config"]["rope_parameters"]["rope_theta"] = 10000
    return config


@pytest.fixture(scope="module", params=["tiny", "variant"])
def models(request, tmp_path_factory):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    if request.param == "tiny":
        directory = request.getfixturevalue("tiny_checkpoint")
    else:
        directory = write_weights(tmp_path_factory.mktemp("variant") / "ckpt", variant_config(), seed=1)
    ours = load_code_predictor(directory, LoadOptions(torch.float32, "cpu"))
    talker = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32
    ).talker.eval()
    # greedy, as the talker sets it when its own `do_sample` is off
    talker.code_predictor.generation_config.do_sample = False
    return ours, talker


def frame_inputs(talker, frames: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Talker hidden states (stand-ins for its final-norm output) and code-0 ids of `frames` frames."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(frames, talker.config.text_config.hidden_size, generator=generator)
    code0 = torch.randint(0, talker.code_predictor.config.vocab_size, (frames,), generator=generator)
    return hidden, code0


@torch.no_grad()
def talker_oracle(talker, hidden: torch.Tensor, code0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes 1.. and the codec sum of one frame per row, from the talker's own step preparation.

    The text part it adds to the sum (`trailing_text_hidden[:, 0]`) is zero here, so what comes back is the
    codec sum alone.
    """
    frames, size = hidden.shape
    zeros = torch.zeros(frames, 1, size)
    inputs = talker.prepare_inputs_for_generation(
        code0[:, None],
        past_key_values=DynamicCache(config=talker.config.text_config),
        hidden_states=(
            (hidden[:, None],),
            None,
        ),  # (per-layer hidden states, residual codes): last layer, last row
        generation_step=0,
        trailing_text_hidden=zeros,
        tts_pad_embed=zeros,
        is_first_iteration=False,
        use_cache=True,
    )
    return inputs["residual_codes"][:, 1:], inputs["inputs_embeds"][:, 0]


@torch.no_grad()
def reference_step_logits(talker, hidden: torch.Tensor, code0: torch.Tensor) -> torch.Tensor:
    """transformers' code predictor logits `[frames, groups - 1, vocab]`, one slice per inner step."""
    predictor = talker.code_predictor
    out = predictor.generate(
        inputs_embeds=torch.stack((hidden, talker.get_input_embeddings()(code0)), dim=1),
        max_new_tokens=predictor.config.num_code_groups - 1,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return torch.stack(out.logits, dim=1).float()


class LogitsRecorder:
    """Greedy, and keeps each step's logits."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        self.logits.append(logits.clone())
        return greedy(logits)


@torch.no_grad()
def run_ours(ours: CodePredictor, talker, hidden: torch.Tensor, code0: torch.Tensor):
    recorder = LogitsRecorder()
    codes, codec_sum = ours.predict_frame(hidden, talker.get_input_embeddings()(code0), recorder)
    return codes, codec_sum, torch.stack(recorder.logits, dim=1)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def test_step_logits_match(models):
    ours, talker = models
    hidden, code0 = frame_inputs(talker, FRAMES, seed=0)
    _, _, logits = run_ours(ours, talker, hidden, code0)
    expected = reference_step_logits(talker, hidden, code0)
    assert logits.shape == expected.shape
    worst = max(relative_error(logits[:, step], expected[:, step]) for step in range(logits.shape[1]))
    print(f"code predictor step logits max relative error {worst:.2e}")
    assert worst <= LOGITS_TOLERANCE


def test_greedy_codes_and_codec_sum_match_the_talkers_step(models):
    ours, talker = models
    hidden, code0 = frame_inputs(talker, FRAMES, seed=1)
    codes, codec_sum, _ = run_ours(ours, talker, hidden, code0)
    expected_codes, expected_sum = talker_oracle(talker, hidden, code0)
    assert codes.tolist() == expected_codes.tolist()
    error = (codec_sum - expected_sum).abs().max().item()
    print(f"codec sum max abs error {error:.2e}")
    assert error <= SUM_TOLERANCE


def test_a_batch_of_frames_equals_each_frame_alone(models):
    ours, talker = models
    hidden, code0 = frame_inputs(talker, FRAMES, seed=2)
    codes, codec_sum, logits = run_ours(ours, talker, hidden, code0)
    for row in range(FRAMES):
        alone = run_ours(ours, talker, hidden[row : row + 1], code0[row : row + 1])
        assert alone[0].tolist() == codes[row : row + 1].tolist()
        assert (alone[1] - codec_sum[row : row + 1]).abs().max().item() <= SUM_TOLERANCE
        assert relative_error(alone[2], logits[row : row + 1]) <= LOGITS_TOLERANCE
