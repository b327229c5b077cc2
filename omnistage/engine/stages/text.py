"""The text stage: an autoregressive stage over token ids (the Thinker, Qwen3-ASR's decoder) on the core of
autoregressive.py, over a token runner: admission (text_admission.py), the model step, sampling, stops and
outputs (output_processor.py). What builds it is in text_setup.py, its requests' prefix-cache keys in
prefix.py.

`TextStage.step()` runs one scheduler step and returns what each touched request gained. Everything a
request does stays inside that request: a failing step fails the requests in it, frees their pages and
the engine goes on. With `decode_ahead` (decode_ahead.py), a step's tokens come out of the `step()` call
after the one that launched it, which queues the next step's forward pass first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from omnistage.engine.decode_ahead import (
    PLACEHOLDER,
    Launched,
    awaits_token,
    launched_or_none,
    may_run_ahead,
    settle,
)
from omnistage.engine.graphs.base import int_buckets
from omnistage.engine.logprobs import step_logprobs
from omnistage.engine.memory.plan import GiB, MemoryPlan, StageMemory, kv_bytes_per_page
from omnistage.engine.memory.summary import text_stage_summary
from omnistage.engine.output_processor import RequestState, request_output, request_state, stop_and_text
from omnistage.engine.scheduler import ScheduledChunk, SchedulerOutput
from omnistage.engine.sequence import Sequence
from omnistage.engine.stages.admission import max_tokens_for
from omnistage.engine.stages.autoregressive import AutoregressiveStage, generators
from omnistage.engine.stages.constrained import Constraints
from omnistage.engine.stages.prefix import request_keys
from omnistage.engine.stages.preparation import prepare_decoder, prepare_encoders
from omnistage.engine.stages.text_admission import Parked, TextAdmission
from omnistage.engine.stages.text_memory import text_stage_memory
from omnistage.engine.stages.text_setup import NewRequest, StageModels, TextSettings
from omnistage.engine.stages.token_runner import TokenRunner
from omnistage.models.layers.rotary import PromptPositions
from omnistage.outputs import RequestOutput, TokenLogprobs
from omnistage.request import SamplingParams

if TYPE_CHECKING:
    from omnistage.engine.structured import GrammarState
    from omnistage.models.multimodal import MultimodalInputs

log = logging.getLogger(__name__)

_CPU_KV_GIB = 0.25

# A step's sampled ids, one per chunk that samples and in their order, and their logprobs (None: not asked).
Sampled = tuple[list[int], list[TokenLogprobs | None]]


class TextStage(AutoregressiveStage[RequestState]):
    """An autoregressive stage over token ids (the Thinker, Qwen3-ASR's decoder) on the core's pool, scheduler
    and sampler (autoregressive.py), over a token runner: admission, decode-ahead steps and their outputs."""

    runner: TokenRunner

    def __init__(
        self, settings: TextSettings, models: StageModels, device: torch.device, dtype: torch.dtype
    ) -> None:
        """The stage over its loaded models. On the CPU its KV pages are allocated at once; on a GPU they and
        its graphs wait for its device's plan, which its `memory()` joins (`allocate`)."""
        section, engine, text = settings.stage, settings.engine, models.text
        # the stage holds its model and encoders before its runner does: the memory report names the first
        # holder of a tensor its owner (`thinker.model`, memory/report.py)
        self.settings, self.dtype = settings, dtype
        self.model, self.encoders, self.processor = models.model, models.encoders, models.processor
        self.compiled = prepare_decoder(models.model, device, engine.moe_kernel, engine.compile)
        prepare_encoders(models.encoders, device, engine.compile)
        runner = TokenRunner(
            models.model, text, engine.page_size, device, dtype, models.tap_layer, engine.prefix_caching
        )
        batch, tokens = section.max_batch, section.max_num_batched_tokens
        super().__init__(models.name, runner, device, engine.page_size, batch, tokens, penalises_prompt=True)
        self.model_path, self.load_seconds = models.model_path, models.load_seconds
        self.tokenizer, self.eos_token_ids = self.processor.tokenizer, models.eos_token_ids
        self.vocab_size = text.vocab_size
        kv = kv_bytes_per_page(
            text.num_hidden_layers, text.num_key_value_heads, text.head_dim, self.page_size, dtype.itemsize
        )
        self.kv_bytes_per_page = kv + runner.tap_bytes_per_page  # the tapped rows kept beside a page's KV
        self.max_model_len = min(
            engine.max_model_len or text.max_position_embeddings, text.max_position_embeddings
        )
        self.plan: MemoryPlan | None = None  # its device's, once granted (`allocate`)
        # the device's main-stream graph pool (`memory.plan.MAIN_POOL`): this stage's prefill graphs and its
        # encoders' graphs; the pipeline captures the other stages of the device into it too
        self.graph_pool: Any = None
        self.capture_seconds = 0.0
        self.decode_ahead = engine.decode_ahead
        self.interval = engine.stream_interval  # a streamed reply's tokens per output
        self.prefix_caching = engine.prefix_caching  # its full prompt pages shared through the pool's cache
        self._launched: Launched[RequestState] | None = None  # the step in flight (decode_ahead)
        self._launch_failed = False  # the next step runs where a failure fails only the requests at fault
        self.constraints: Constraints[Parked] = Constraints(
            self.tokenizer, self.vocab_size, self.eos_token_ids
        )
        self.admission = TextAdmission(
            self.name,
            lambda: self.scheduler,
            self.encoders,
            self.constraints,
            self.validate,
            self._sequence,
            self.device,
            keys_media=self.prefix_caching,
        )
        self.media = self.admission.media  # the encoder rows on the device (limited once planned)
        self.media.ahead_vision_rows = 2 * tokens  # images and videos encoded two steps ahead of the prefill
        if self.device.type != "cuda":
            cpu_gib = section.kv.gib or _CPU_KV_GIB
            self.allocate_pages(section.kv.pages or max(1, int(cpu_gib * GiB) // self.kv_bytes_per_page))

    def stats(self) -> dict[str, int]:
        held = {"num_waiting": self.num_waiting, "encoder_rows_held_bytes": self.media.held_bytes}
        return super().stats() | self.encoders.stats() | held

    def memory(self) -> StageMemory:
        """What the stage needs of its GPU's plan: its weights and encoders', its floor, its KV pool and its
        graphs' prices, measured now (the runner warms up on the way)."""
        return text_stage_memory(
            self.runner,
            self.encoders,
            self.settings,
            self.kv_bytes_per_page,
            max_prompt_tokens=self.max_model_len - 1,
            max_media=(self.processor.max_audios, self.processor.max_images),
            stage=self.name,
        )

    def allocate(self, plan: MemoryPlan, pool: Any = None) -> None:
        """Its KV pages and CUDA graphs (its own and its encoders') as its device's `plan` grants them; the
        graphs record the pages' addresses, so the pages come first. Its prefill and encoder graphs go into
        `pool` (the device's main-stream pool where another stage made it) or a new one, `graph_pool`."""
        self.plan = plan
        self.allocate_pages(plan.kv_pool(self.name).pages)
        started = time.perf_counter()
        self.graph_pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.runner.capture_graphs(
            int_buckets(plan.captured(self.name, "decode")),
            self.max_model_len,
            self.settings.engine.enforce_eager,
            prefill_buckets=int_buckets(plan.captured(self.name, "prefill")),
            prefill_pool=self.graph_pool,
            max_seqs=self.max_batch,
        )
        # the towers run between this stage's steps and their rows are copied out at once
        self.encoders.capture_graphs(
            int_buckets(plan.captured("audio encoder", "prefill")),
            int_buckets(plan.captured("vision encoder", "prefill")),
            pool=self.graph_pool,
        )
        self.capture_seconds = time.perf_counter() - started
        self.media.limit = self.encoders.rows_limit
        if self.media.limit is not None:
            log.info(
                "%s: encoder rows on the device at once: up to %.0f MiB (--encoder-rows-mib, or the largest "
                "media request's); requests beyond wait unencoded",
                self.name,
                self.media.limit / 2**20,
            )
        log.debug("%s", self.memory_summary())

    def memory_summary(self) -> str:
        return text_stage_summary(self)

    @property
    def context_tokens(self) -> int:
        """The longest request (prompt and output) it serves: its context, or what its whole pool holds where
        that is less (a pool the plan shrank to start: memory/planner.py). What the server advertises."""
        return min(self.max_model_len, self.pool.num_pages * self.page_size)

    # -- requests -----------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against the model and the pool; return its effective max_tokens."""
        return max_tokens_for(
            prompt_token_ids,
            params,
            self.max_model_len,
            self.vocab_size,
            self.pool,
            self.settings.engine.max_tokens_default,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        mrope: PromptPositions | None = None,
        mm: MultimodalInputs | None = None,
    ) -> None:
        """Admit one request; raises what makes it unservable (nothing is admitted then)."""
        request = NewRequest(request_id, prompt_token_ids, params, prompt, mrope, mm)
        error = self.add_requests([request])[0]
        if error is not None:
            raise error

    def add_requests(self, requests: list[NewRequest]) -> list[Exception | None]:
        """Admit several requests (text_admission.py); per request, None or the exception that kept it out."""
        return self.admission.add(requests)

    def _sequence(self, parked: Parked, grammar: GrammarState | None) -> Sequence[RequestState]:
        r = parked.request
        state = request_state(
            r, parked.mm, r.tap, self.tokenizer, self.eos_token_ids, self.device, grammar, self.interval
        )
        state.metrics.update(parked.metrics)
        keys = request_keys(r, parked.mm, r.tap, self.runner) if self.prefix_caching else None
        return Sequence(r.request_id, list(r.prompt_token_ids), parked.max_tokens, prefix=keys, data=state)

    def abort(self, request_id: str) -> RequestOutput | None:
        if self.admission.abort(request_id):
            return None
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        if self._launched is not None and not any(map(awaits_token, self._launched.chunks)):
            self._launched = None  # nothing in flight is wanted; its KV writes precede any later step's
        return request_output(seq, "", [])

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or self._launched is not None or len(self.admission) > 0

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + len(self.admission)

    def replays_next_step(self) -> bool:
        """The next step is a decode step whose batch a captured graph holds: no eager (compiled) code runs."""
        graphs = self.runner.graphs
        return (
            graphs is not None
            and self.scheduler.decodes_only
            and 0 < self.scheduler.num_running <= max(int_buckets(graphs.captured_buckets), default=0)
        )

    # -- one step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        restoring = self.media.needs_restore(self.scheduler.waiting)
        failed = self.admission.turn() if len(self.admission) or restoring else []
        return failed + self._step()

    def _step(self) -> list[RequestOutput]:
        if self.decode_ahead and not self._launch_failed and may_run_ahead(self.scheduler, _decodes_ahead):
            return self._step_ahead()
        if self._launched is not None:  # the next step needs the tokens of the one in flight
            launched, self._launched = self._launched, None
            return settle(launched, self._apply_token, self._fail)
        self._launch_failed = False
        step = self.scheduler.schedule(self._ready())
        if not step.chunks:
            return []
        now = time.monotonic()
        for chunk in step.chunks:
            chunk.seq.data.metrics.setdefault("scheduled", now)
        return self._run(step.chunks)

    def _ready(self) -> Callable[[Sequence[RequestState]], bool] | None:
        """What keeps a preempted sequence whose rows are on the host out of a step (media_hold.py), if any."""
        return self.media.ready if self.media.needs_restore(self.scheduler.waiting) else None

    def _step_ahead(self) -> list[RequestOutput]:
        """Launch a step on the ids of the one in flight, then apply those, then sample it (decode_ahead.py):
        the host applies the ids in flight while the device runs the step's forward pass, and the step's
        grammar masks are filled past them before it samples."""
        previous, self._launched = self._launched, None
        running = self.scheduler.num_running
        step = self.scheduler.schedule(self._ready())
        sampling = [c for c in step.chunks if c.samples]
        # those running before passed `may_run_ahead`; those `schedule` admitted (appended) are judged here
        admitted = self.scheduler.running[running:]
        launches = bool(sampling) and not step.preempted and all(_decodes_ahead(seq) for seq in admitted)
        if not launches:
            return (
                self._run(step.chunks)
                if previous is None
                else settle(previous, self._apply_token, self._fail)
            )
        now = time.monotonic()
        for chunk in step.chunks:
            chunk.seq.data.metrics.setdefault("scheduled", now)
        saved = [(g, g.get_state()) for g in generators(sampling)]
        logits = launched_or_none(lambda: self._launch(step.chunks, previous))
        outputs = settle(previous, self._apply_token, self._fail) if previous is not None else []
        if logits is not None:
            self._launched = launched_or_none(lambda: self._sample_ahead(step.chunks, logits))
        if self._launched is None:
            for generator, state in saved:  # the step runs again: its draws start where they stood
                generator.set_state(state)
            if previous is None:  # run it again here, where a failure fails only the requests at fault
                return self._run(step.chunks)
            self._launch_failed = True  # the next step() runs it again, one step after the other
        return outputs

    def _launch(
        self, chunks: list[ScheduledChunk[RequestState]], previous: Launched[RequestState] | None
    ) -> torch.Tensor:
        """Queue a step's forward pass on the ids of `previous` (still on the device) without waiting for it:
        the logits of its sampling chunks, to sample once `previous` is applied (`_sample_ahead`)."""
        input_ids = previous.input_ids(chunks) if previous is not None else None
        return self.runner.execute(SchedulerOutput(chunks), input_ids)

    def _sample_ahead(
        self, chunks: list[ScheduledChunk[RequestState]], logits: torch.Tensor
    ) -> Launched[RequestState]:
        """Sample a launched step's `logits` without waiting for the ids; each of its sampling sequences gets a
        placeholder token. A sequence that ended on the ids applied since is sampled unconstrained, and its
        token is dropped (`settle`)."""
        sampling = [c for c in chunks if c.samples]
        rows = [self.sampling_row(c.seq) for c in sampling]
        sampled = self.sampler(logits, rows)
        launched = Launched.start(sampling, sampled, step_logprobs(logits, sampled, rows))
        self.scheduler.update(SchedulerOutput(chunks), {c.seq.request_id: PLACEHOLDER for c in sampling})
        if self.media.holding:
            self.media.release()
        return launched

    def _run(self, chunks: list[ScheduledChunk[RequestState]]) -> list[RequestOutput]:
        """Run `chunks` as one model step and apply what it sampled; a failure fails only the requests at
        fault (see isolation.run_isolated)."""
        return self.isolated(
            chunks, self._sample_step, self._apply, lambda chunk, exc: self._fail(chunk.seq, exc)
        )

    def _sample_step(self, chunks: list[ScheduledChunk[RequestState]]) -> Sampled:
        """The ids sampled after the chunks that end in a sample, in chunk order, and their logprobs."""
        rows = [self.sampling_row(c.seq) for c in chunks if c.samples]
        logits = self.runner.execute(SchedulerOutput(chunks))
        if not rows:
            return [], []
        sampled = self.sampler(logits, rows)
        logprobs = step_logprobs(logits, sampled, rows)
        tokens = sampled.tolist()
        return tokens, logprobs.per_row(tokens) if logprobs is not None else [None] * len(tokens)

    def _apply(self, chunks: list[ScheduledChunk[RequestState]], sampled: Sampled) -> list[RequestOutput]:
        tokens, logprobs = sampled
        sampling = self.update(chunks, tokens)
        if self.media.holding:
            self.media.release()
        return [
            out
            for chunk, token, token_logprobs in zip(sampling, tokens, logprobs)
            for out in self._apply_token(chunk.seq, token, token_logprobs)
        ]

    def _apply_token(
        self, seq: Sequence[RequestState], token: int, logprobs: TokenLogprobs | None
    ) -> list[RequestOutput]:
        """What `seq` gained by its sampled `token` (and its `logprobs`, where it asked), if its output is wanted
        now; a failure (of its stop strings, its detokenizing) is its own."""
        try:
            out = self._after_sample(seq, token, logprobs)
        except Exception as exc:
            return self._fail(seq, exc)
        return [] if out is None else [out]

    def _after_sample(
        self, seq: Sequence[RequestState], token: int, logprobs: TokenLogprobs | None
    ) -> RequestOutput | None:
        state = seq.data
        first = "first_token" not in state.metrics
        if first:
            state.metrics["first_token"] = time.monotonic()
        if logprobs is not None and state.logprobs is not None:
            state.logprobs.append(logprobs)
        status, delta = stop_and_text(state, token)
        if status is not None:
            self.scheduler.finish(seq, status)
        if seq.is_finished and not state.detokenizer.stopped:
            delta += state.detokenizer.flush()
        if state.final_only and not seq.is_finished:
            return None  # its deltas are in its detokenizer's text and its ids, which the last output carries
        if not (first or seq.is_finished or len(state.held_ids) + 1 >= state.stream_interval):
            state.hold(delta, token, logprobs)  # its next output carries them (`stream_interval`)
            return None
        return request_output(seq, delta, [token], [logprobs] if logprobs is not None else [])

    def _fail(self, seq: Sequence[RequestState], exc: Exception) -> list[RequestOutput]:
        """End `seq` with finish_reason "error" and its error."""
        self.end_failed(seq, exc)
        return [request_output(seq, "", [])]


def _decodes_ahead(seq: Sequence[RequestState]) -> bool:
    return seq.data.decodes_ahead
