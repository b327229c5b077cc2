"""The Talker's decode graphs on the CPU: off CUDA, `capture_graphs` binds eager calls over the same static
buffers, so bucket choice, padding rows and the graph step's masked logits are checked against the plain
eager path here (the capture itself is checked in tests/gpu/test_talker_graphs_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from omnistage.engine.attention import TorchReferenceBackend
from omnistage.engine.buckets import bucket_for
from omnistage.engine.memory.measure import Peak
from omnistage.engine.memory.plan import scaled_costs
from omnistage.engine.scheduler import SchedulerOutput
from omnistage.engine.stages.base import Stage
from omnistage.engine.stages.row_runner import RowRunner
from omnistage.engine.stages.rows import RowStage
from omnistage.models.layers.rotary import PromptPositions
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_omni.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.talker import load_talker
from omnistage.request import SamplingParams, talker_sampling_defaults

PAGE = 4


@pytest.fixture(scope="module")
def talker(tiny_checkpoint):
    return load_talker(tiny_checkpoint, LoadOptions(torch.float32, "cpu"), TorchReferenceBackend())


@pytest.fixture(scope="module")
def cfg(tiny_checkpoint) -> Qwen3OmniConfig:
    return Qwen3OmniConfig.from_dir(tiny_checkpoint)


def make_stage(talker, cfg: Qwen3OmniConfig, num_pages: int = 64, batch_tokens: int = 256) -> RowStage:
    vocab, eos = cfg.talker.text.vocab_size, cfg.talker.codec_eos_token_id
    runner = RowRunner(
        talker, cfg.talker.text, PAGE, torch.device("cpu"), torch.float32, max_seqs=8,
        suppressed_ids=[i for i in range(vocab - 1024, vocab) if i != eos],
    )  # fmt: skip
    return RowStage(
        runner, num_pages=num_pages, max_num_seqs=8, max_num_batched_tokens=batch_tokens, eos_token_id=eos
    )


def sampled(seed: int, max_tokens: int, **kw) -> SamplingParams:
    """The Talker's own sampling (temperature 0.9, top-k 50, repetition penalty 1.05), seeded."""
    return SamplingParams(
        **{**vars(talker_sampling_defaults()), "max_tokens": max_tokens, "seed": seed, **kw}
    )


def row(hidden: int, *key: int) -> torch.Tensor:
    return torch.randn(hidden, generator=torch.Generator().manual_seed(hash(key) % 2**31))


def speak(stage: RowStage, params: list[SamplingParams]) -> list[list[tuple]]:
    """Run requests of prompts of different lengths and M-RoPE deltas to the end, feeding each the same rows
    whatever path runs; per step, (request, token, hidden, finished) of every sample."""
    hidden = stage.runner.cfg.hidden_size
    for i, p in enumerate(params):
        length = 5 + 2 * i
        prompt = torch.stack([row(hidden, i, -1 - j) for j in range(length)])
        positions = torch.arange(length).expand(3, -1).clone()
        positions[1:, 1:] += torch.tensor([[2], [1]])  # as after an image: the streams differ
        stage.add(str(i), prompt, PromptPositions(positions, delta=i - 1), p, p.max_tokens)
    steps, fed = [], dict.fromkeys(map(str, range(len(params))), 0)
    while stage.has_unfinished():
        out = stage.step()
        steps.append([(s.request_id, s.token, s.hidden.clone(), s.finished) for s in out])
        for s in out:
            if not s.finished:
                stage.feed(s.request_id, row(hidden, int(s.request_id), fed[s.request_id]))
                fed[s.request_id] += 1
    return steps


def schedules_of(stage: RowStage) -> list[SchedulerOutput]:
    """The steps the stage's scheduler hands out from now on, in order."""
    outputs = []
    schedule = stage.scheduler.schedule
    stage.scheduler.schedule = lambda ready=None: outputs.append(schedule(ready)) or outputs[-1]
    return outputs


def replays_of(stage: RowStage) -> list[int]:
    """The buckets the stage's graphs replay from now on, in order."""
    replayed = []
    stage.runner.graphs.on_replay = replayed.append
    return replayed


def assert_same_steps(got: list[list[tuple]], want: list[list[tuple]]) -> None:
    assert [[(r, t, f) for r, t, _, f in step] for step in got] == [
        [(r, t, f) for r, t, _, f in step] for step in want
    ]
    for got_step, want_step in zip(got, want, strict=True):
        for (*_, got_hidden, _), (*_, want_hidden, _) in zip(got_step, want_step, strict=True):
            # a GEMM over the padded bucket may round the real rows' last bits differently
            torch.testing.assert_close(got_hidden, want_hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_pages", [64, 8])  # 8 pages: the newest request is preempted and recomputed
def test_three_requests_in_bucket_four_equal_the_plain_path(talker, cfg, num_pages):
    params = [sampled(11, 8), sampled(12, 8, ignore_eos=True), sampled(13, 5, temperature=0.0)]
    plain = make_stage(talker, cfg, num_pages)
    want = speak(plain, params)
    graphs = make_stage(talker, cfg, num_pages)
    assert graphs.runner.captured_buckets == []
    assert (
        graphs.runner.capture_graphs([1, 2, 4], max_seq_len=32) == [1, 2, 4] == graphs.runner.captured_buckets
    )
    replayed, outputs = replays_of(graphs), schedules_of(graphs)
    got = speak(graphs, params)
    assert_same_steps(got, want)
    # every decode step replayed its batch's bucket (3 rows in bucket 4, then 2 rows in bucket 2); the
    # prompts, and a recompute after a preemption, ran eagerly
    assert replayed == [bucket_for(len(o.chunks), [1, 2, 4]) for o in outputs if o.is_pure_decode]
    assert replayed[0] == 4 and 2 in replayed
    assert any(o.preempted for o in outputs) == (num_pages == 8)
    # the padding rows wrote nothing: both caches hold the same keys and values
    for got_kv, want_kv in zip(graphs.runner.kv_caches, plain.runner.kv_caches, strict=True):
        torch.testing.assert_close(got_kv, want_kv, rtol=1e-5, atol=1e-5)
    assert graphs.pool.num_free == graphs.pool.num_pages


def test_batches_beyond_the_largest_bucket_run_eagerly(talker, cfg):
    params = [sampled(20 + i, n, ignore_eos=True) for i, n in enumerate([3, 4, 6, 6, 6])]
    want = speak(make_stage(talker, cfg), params)
    stage = make_stage(talker, cfg)
    stage.runner.capture_graphs([1, 2, 4], max_seq_len=32)
    replayed = replays_of(stage)
    got = speak(stage, params)
    assert_same_steps(got, want)
    # five rows (twice) run eagerly, then 4 rows replay bucket 4, then 3 rows (twice) bucket 4
    assert [len(step) for step in got] == [5, 5, 5, 4, 3, 3]
    assert replayed == [4, 4, 4]


def test_a_request_longer_than_the_graphs_block_table_runs_eagerly(talker, cfg):
    params = [sampled(30, 6, ignore_eos=True)]
    want = speak(make_stage(talker, cfg), params)
    stage = make_stage(talker, cfg)
    stage.runner.capture_graphs([1], max_seq_len=8)  # block tables of 2 pages
    replayed = replays_of(stage)
    assert_same_steps(speak(stage, params), want)
    assert replayed == [1, 1, 1]  # fed rows at positions 5, 6 and 7; 8 and 9 need a third page


def test_a_prompts_last_row_alone_replays_a_graph_at_its_prompt_position(talker, cfg):
    params = [sampled(40, 8, ignore_eos=True)]
    want = speak(make_stage(talker, cfg), params)  # the whole prompt in one chunk
    stage = make_stage(talker, cfg, batch_tokens=4)  # the prompt of 5 rows in chunks of 4 and 1
    stage.runner.capture_graphs([1], max_seq_len=32)
    replayed, outputs = replays_of(stage), schedules_of(stage)
    got = speak(stage, params)
    last = outputs[1].chunks[0]  # the prompt's last row, alone: a decode-shaped step at its M-RoPE position
    assert outputs[1].is_pure_decode and last.start == 4 == last.seq.num_prompt_tokens - 1
    assert replayed == [1] * 8  # that row, then the 7 fed rows
    # the first chunk samples nothing; chunked attention reads cached keys: other rounding, the same tokens
    assert got[0] == []
    assert_same_steps(got[1:], want)


def test_graph_costs_scale_the_largest_buckets_eager_decode_peak(talker, cfg):
    stage = make_stage(talker, cfg)
    asked = []
    stage.runner.profile_peak = lambda tokens, seqs=1: asked.append((tokens, seqs)) or Peak(3 << 20, 1 << 20)
    costs = stage.runner.graph_costs([1, 2, 4, 8])
    assert {b: p.bytes for b, p in costs.items()} == scaled_costs(3 << 20, [1, 2, 4, 8])
    assert {b: p.kept for b, p in costs.items()} == scaled_costs(1 << 20, [1, 2, 4, 8])
    assert asked == [(8, 8)]  # one decode step of the largest bucket: 8 sequences of one row
    assert stage.runner.graph_costs([]) == {} and asked == [(8, 8)]


def test_no_buckets_capture_nothing(talker, cfg):
    stage = make_stage(talker, cfg)
    assert stage.runner.capture_graphs([], max_seq_len=32) == [] == stage.runner.captured_buckets
    assert bucket_for(1, stage.runner.captured_buckets) is None


def _with_prefill_graphs(talker, cfg, num_pages: int) -> tuple[RowStage, list[int]]:
    """A stage with decode graphs for 1 and 2 rows and prefill graphs, and the slots of each prefill replay."""
    stage = make_stage(talker, cfg, num_pages)
    stage.runner.capture_graphs([1, 2], max_seq_len=32)
    assert stage.runner.capture_prefill_graphs([16, 32, 64], max_seq_len=32) == [16, 32, 64]
    assert stage.runner.prefill_graphs.buffers.max_seqs == 8  # the stage's max_num_seqs
    prefills: list[int] = []
    run = stage.runner.prefill_graphs.run
    stage.runner.prefill_graphs.run = lambda *a: (prefills.append(a[2].seq_lens.shape[0]), run(*a))[1]
    return stage, prefills


def test_prompts_and_steps_beside_them_replay_prefill_graphs_as_eager_computes(talker, cfg):
    """The Talker's prefill graphs: prompts of several requests in one step and a decode batch past the decode
    graphs, padded to token buckets and sequence slots, give the tokens and hidden states of the plain path."""
    params = [sampled(40 + i, n, ignore_eos=True) for i, n in enumerate([3, 5, 6, 6, 4])]
    want = speak(make_stage(talker, cfg), params)
    stage, prefills = _with_prefill_graphs(talker, cfg, 64)
    outputs = schedules_of(stage)
    got = speak(stage, params)
    assert_same_steps(got, want)
    offered = [o for o in outputs if o.chunks and not (o.is_pure_decode and len(o.chunks) <= 2)]
    assert len(prefills) == len(offered) > 0  # every step but the decode graphs' went to the prefill graphs
    assert any(len(o.chunks) > 1 and not o.is_pure_decode for o in offered)  # prompts together
    assert any(o.is_pure_decode for o in offered)  # five rows: past the decode graphs
    assert stage.pool.num_free == stage.pool.num_pages


def test_a_recompute_after_a_preemption_replays_a_prefill_graph(talker, cfg):
    params = [sampled(11, 8), sampled(12, 8, ignore_eos=True), sampled(13, 5, temperature=0.0)]
    want = speak(make_stage(talker, cfg, 8), params)
    stage, prefills = _with_prefill_graphs(talker, cfg, 8)
    outputs = schedules_of(stage)
    got = speak(stage, params)
    assert_same_steps(got, want)
    assert any(o.preempted for o in outputs) and prefills
    assert stage.pool.num_free == stage.pool.num_pages


def test_the_row_stage_is_a_stage_that_names_its_needs(talker, cfg):
    """What it brings to its device's plan: its weights, a whole step's prefill peak and a pool for one request
    of its longest length; no graphs outside bfloat16 (the graph-safe MoE kernels need it)."""
    stage = make_stage(talker, cfg)
    stage = RowStage(
        stage.runner, num_pages=8, max_num_seqs=8, max_num_batched_tokens=256, eos_token_id=stage.eos_token_id,
        max_seq_len=32, decode_sizes=[1, 2], prefill_sizes=[16],
    )  # fmt: skip
    assert isinstance(stage, Stage)
    stage.runner.profile_peak = lambda tokens, seqs=1: Peak(3 << 20, 1 << 20)
    need = stage.memory()
    assert [(name, what) for name, _, what in need.resident] == [("Talker", "weights")]
    assert need.peaks == (("Talker prefill", 3 << 20, "256 rows"),)
    assert [(kv.stage, kv.min_pages) for kv in need.kv] == [("Talker", 32 // PAGE)] and need.graphs == ()
    assert stage.stats()["kv_pages_total"] == 8
