"""One autoregressive stage (the Thinker): admission, scheduling, the model step, sampling, stops.

`TextStage.step()` runs one scheduler step and returns what each touched request gained. Everything a
request does stays inside that request: a failing step fails the requests in it, frees their pages and
the engine goes on. With `decode_ahead` (decode_ahead.py), a decode step's tokens come out of the `step()`
call after the one that launched it, which launches the next step first.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from omnistage.config import EngineConfig
from omnistage.engine.decode_ahead import (
    PLACEHOLDER,
    Launched,
    decodes_ahead,
    may_run_ahead,
)
from omnistage.engine.detokenizer import IncrementalDetokenizer
from omnistage.engine.encoder_engine import EncoderEngine, MultimodalEmbeds
from omnistage.engine.graphs.base import int_buckets
from omnistage.engine.isolation import run_isolated
from omnistage.engine.kv_cache import PagePool
from omnistage.engine.memory.measure import allocator_stats, module_bytes
from omnistage.engine.memory.plan import GiB, MemoryPlan, StageMemory, kv_bytes_per_page
from omnistage.engine.output_processor import RequestState, request_output, stop_and_text
from omnistage.engine.sampling import Sampler, SamplingRow, make_generator
from omnistage.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from omnistage.engine.sequence import Sequence, SequenceStatus
from omnistage.engine.stages.decoder import DecoderSizes, StageProcessor, TokenDecoder, torch_module
from omnistage.engine.stages.text_memory import text_stage_memory
from omnistage.engine.stages.token_runner import HiddenTap, TokenRunner
from omnistage.errors import InvalidRequest, RequestTooLarge
from omnistage.models.layers.linear import adopt_gemv
from omnistage.models.layers.moe import SparseMoeBlock
from omnistage.models.layers.rotary import PromptPositions
from omnistage.outputs import RequestOutput
from omnistage.request import GenerationRequest, SamplingParams

if TYPE_CHECKING:
    from omnistage.request import MultimodalInputs  # a request's media, as the edge decodes them

log = logging.getLogger(__name__)

_CPU_KV_GIB = 0.25


@dataclass(frozen=True)
class NewRequest(GenerationRequest):
    """A request as the stage takes it: the caller's (speech is the pipeline's business), and what the pipeline
    adds for a later stage."""

    tap: HiddenTap | None = None  # hidden states of prompt rows that a later stage reads

    @classmethod
    def of(cls, request: GenerationRequest, tap: HiddenTap | None = None) -> NewRequest:
        r = request
        return cls(r.request_id, r.prompt_token_ids, r.params, r.prompt, r.mrope, r.mm, r.speech, tap)


@dataclass
class StageModels:
    """What a family's pipeline loads for an LLM stage (see pipeline/qwen3_omni.py): the decoder, its sizes,
    the processor that lays out its prompts, the encoders that fill their placeholders, and its end tokens."""

    model: TokenDecoder
    text: DecoderSizes
    processor: StageProcessor
    encoders: EncoderEngine
    eos_token_ids: list[int]
    model_path: Path
    load_seconds: float
    # the layer whose hidden states a later stage reads from prompt rows (the Talker's accept_hidden_layer), if
    # one does: the prefill graphs record it too, so that a prompt with media a reply is spoken for replays them
    tap_layer: int | None = None
    name: str = "Thinker"  # the stage's name in its device's memory plan


class TextStage:
    def __init__(
        self, config: EngineConfig, models: StageModels, device: torch.device, dtype: torch.dtype
    ) -> None:
        """The stage over its loaded models. On the CPU its KV pages are allocated at once; on a GPU they and
        its graphs wait for its device's plan, which its `memory()` joins (`allocate`)."""
        self.config, self.name = config, models.name
        self.device, self.dtype = device, dtype
        self.model, self.encoders, self.processor = models.model, models.encoders, models.processor
        self.model_path, self.load_seconds = models.model_path, models.load_seconds
        self.tokenizer = self.processor.tokenizer
        self.eos_token_ids = models.eos_token_ids
        text = models.text
        self.vocab_size = text.vocab_size
        self.set_moe_kernel(config.moe_kernel)
        if self.device.type == "cuda":
            # a decode step at one row: each projection where the Triton GEMV streams it faster than cuBLAS
            adopted = adopt_gemv(torch_module(self.model))
            log.info("one-row projections on the Triton GEMV: %d (%s)", len(adopted), ", ".join(adopted[:4]))
        self.compiled = self.device.type == "cuda" and config.compile
        if self.compiled:
            # Regional compilation: the 48 identical decoder layers share one compiled graph, which fuses
            # the norms, rotary, routing and activation glue around the attention and MoE kernels.
            for layer in self.model.model.layers:
                layer.compile(dynamic=True)
        self.page_size = config.page_size
        self.kv_bytes_per_page = kv_bytes_per_page(
            text.num_hidden_layers,
            text.num_key_value_heads,
            text.head_dim,
            self.page_size,
            self.dtype.itemsize,
        )
        self.max_model_len = min(
            config.max_model_len or text.max_position_embeddings, text.max_position_embeddings
        )
        self.runner = TokenRunner(self.model, text, self.page_size, self.device, self.dtype, models.tap_layer)
        self.plan: MemoryPlan | None = None  # its device's, once granted (`allocate`)
        # the device's main-stream graph pool (`memory.plan.MAIN_POOL`): this stage's prefill graphs and its
        # encoders' graphs; the pipeline captures the other stages of the device into it too
        self.graph_pool: Any = None
        self.capture_seconds = 0.0
        self.sampler = Sampler()
        self.decode_ahead = config.decode_ahead
        self._launched: Launched | None = None  # the decode step in flight (decode_ahead)
        self._launch_failed = False  # the next step runs where a failure fails only the requests at fault
        if self.device.type != "cuda":
            cpu_gib = config.kv_cache_memory_gib or _CPU_KV_GIB
            self._allocate_pages(config.num_kv_pages or max(1, int(cpu_gib * GiB) // self.kv_bytes_per_page))

    def memory(self) -> StageMemory:
        """What the stage needs of its GPU's plan: its weights and encoders', its floor, its KV pool and its
        graphs' prices, measured now (the runner warms up on the way)."""
        return text_stage_memory(
            self.runner,
            self.encoders,
            self.config,
            self.kv_bytes_per_page,
            max_prompt_tokens=self.max_model_len - 1,
            max_media=(self.processor.max_audios, self.processor.max_images),
            stage=self.name,
        )

    def allocate(self, plan: MemoryPlan) -> None:
        """Its KV pages and CUDA graphs (its own and its encoders') as its device's `plan` grants them; the
        graphs record the pages' addresses, so the pages come first."""
        self.plan = plan
        self._allocate_pages(plan.kv_pool(self.name).pages)
        started = time.perf_counter()
        self.graph_pool = torch.cuda.graph_pool_handle()
        self.runner.capture_graphs(
            int_buckets(plan.captured(self.name, "decode")),
            self.max_model_len,
            self.config.enforce_eager,
            prefill_buckets=int_buckets(plan.captured(self.name, "prefill")),
            prefill_pool=self.graph_pool,
            max_seqs=self.config.max_num_seqs,
        )
        # the towers run between this stage's steps and their rows are copied out at once
        self.encoders.capture_graphs(
            int_buckets(plan.captured("audio encoder", "prefill")),
            int_buckets(plan.captured("vision encoder", "prefill")),
            pool=self.graph_pool,
        )
        self.capture_seconds = time.perf_counter() - started
        log.debug("%s", self.memory_summary())

    def _allocate_pages(self, num_pages: int) -> None:
        self.pool = PagePool(num_pages, self.page_size)
        self.runner.allocate_kv(num_pages)
        self.scheduler = Scheduler(self.pool, self.config.max_num_seqs, self.config.max_num_batched_tokens)

    def set_moe_kernel(self, kernel: str) -> None:
        """Choose the GPU MoE kernel of every layer (captured decode graphs keep the one they recorded)."""
        for module in self.model.modules():
            if isinstance(module, SparseMoeBlock):
                module.kernel = kernel

    def memory_summary(self) -> str:
        kv_gib = self.pool.num_pages * self.kv_bytes_per_page / GiB
        weights_gib = module_bytes(torch_module(self.model)) / GiB
        graphs = ""
        if self.device.type == "cuda" and self.config.enforce_eager:
            graphs = "; no CUDA graphs (enforce_eager): every step runs eagerly"
        elif self.device.type == "cuda":
            decode = self.runner.graphs.captured_buckets if self.runner.graphs else []
            prefill = self.runner.prefill_graphs.captured_buckets if self.runner.prefill_graphs else []
            planned = self.plan.graph_set(self.name, "decode") if self.plan else None
            eager = planned.eager if planned else ()
            graphs = (
                f"; decode CUDA graphs for batch {', '.join(map(str, decode))} "
                f"(eager: larger batches{', ' + ', '.join(map(str, eager)) if eager else ''})"
                f"{self.runner.graphs.routes_note()}"
                if decode and self.runner.graphs is not None
                else "; decode steps run eagerly"
            )
            graphs += (
                f"; prefill CUDA graphs for steps of {prefill[0]}..{prefill[-1]} tokens of up to "
                f"{self.runner.prefill_graphs.buffers.max_seqs} sequences ({len(prefill)} buckets; longer steps "
                "and images' run eagerly)"
                if prefill and self.runner.prefill_graphs is not None
                else "; prefill steps run eagerly"
            )
            towers = self.encoders.captured
            for tower, unit in (("audio", "windows"), ("vision", "patches")):
                if towers[tower]:
                    graphs += f"; {tower} encoder CUDA graphs for {unit} {', '.join(map(str, towers[tower]))}"
            if decode or prefill or any(towers.values()):
                graphs += f"; graphs captured in {self.capture_seconds:.1f} s"
        return (
            f"model {self.model_path} on {self.device} ({str(self.dtype).removeprefix('torch.')}), "
            f"weights {weights_gib:.2f} GiB loaded in {self.load_seconds:.1f} s; "
            f"KV pool {self.pool.num_pages:,} pages x {self.page_size} tokens = {kv_gib:.2f} GiB "
            f"({self.pool.num_pages * self.page_size:,} tokens); max model length {self.max_model_len:,}{graphs}"
        )

    # -- requests -----------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against the model and the pool; return its effective max_tokens."""
        if not prompt_token_ids:
            raise InvalidRequest("the prompt is empty")
        prompt_len = len(prompt_token_ids)
        if prompt_len >= self.max_model_len:  # before the scan below, which a huge prompt would make slow
            raise RequestTooLarge(
                f"the prompt has {prompt_len:,} tokens; the model's context is {self.max_model_len:,} tokens"
            )
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary of {self.vocab_size}")
        if (
            params.max_tokens is None
        ):  # the configured default, within what the context and the whole pool allow
            max_tokens = min(self.max_model_len, self.pool.num_pages * self.page_size) - prompt_len
            if max_tokens < 1:
                self.pool.check_admissible(prompt_len + 1)
            if self.config.max_tokens_default is not None:
                max_tokens = min(max_tokens, self.config.max_tokens_default)
        else:
            max_tokens = params.max_tokens
        if prompt_len + max_tokens > self.max_model_len:
            raise RequestTooLarge(
                f"prompt ({prompt_len:,} tokens) + max_tokens ({max_tokens:,}) = {prompt_len + max_tokens:,} "
                f"tokens exceeds the model's context of {self.max_model_len:,} tokens"
            )
        self.pool.check_admissible(prompt_len + max_tokens)
        return max_tokens

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
        """Admit several requests; their media go through the encoders together (one ragged batch per
        tower). Returns, per request, None or the exception that kept it out; the others are admitted."""
        arrival = time.monotonic()
        errors: list[Exception | None] = [None] * len(requests)
        max_tokens: dict[int, int] = {}
        for i, r in enumerate(requests):
            try:
                max_tokens[i] = self.validate(r.prompt_token_ids, r.params)
            except Exception as exc:
                errors[i] = exc
        embeds = self._encode({i: requests[i] for i in max_tokens})
        encoded = time.monotonic()
        for i, r in enumerate(requests):
            if i not in max_tokens:
                continue
            if isinstance(mm := embeds.get(i), Exception):
                errors[i] = mm
                continue
            params = r.params
            state = RequestState(
                params=params,
                prompt=r.prompt,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer,
                    params.skip_special_tokens,
                    params.stop or [],
                    params.include_stop_str_in_output,
                ),
                generator=make_generator(params, self.device),
                eos_token_ids=[] if params.ignore_eos else self.eos_token_ids,
                mrope=r.mrope,
                mm=mm,
                tap=r.tap,
                decodes_ahead=decodes_ahead(params, feeds_a_stage=r.speech is not None),
                metrics={"arrival": arrival, "encoded": encoded},
            )
            self.scheduler.add(Sequence(r.request_id, list(r.prompt_token_ids), max_tokens[i], data=state))
        return errors

    def _encode(self, requests: dict[int, NewRequest]) -> dict[int, MultimodalEmbeds | Exception]:
        """Encoder outputs per index of the requests with media, all in one call; when that call fails, one
        request at a time, so that only the request at fault fails."""
        media = {i: (r.prompt_token_ids, r.mm) for i, r in requests.items() if r.mm is not None}
        if not media:
            return {}
        try:
            return dict(zip(media, self.encoders.encode_many(list(media.values()))))
        except Exception as exc:
            if len(media) == 1:
                return {i: exc for i in media}
        results: dict[int, MultimodalEmbeds | Exception] = {}
        for i, (token_ids, mm) in media.items():
            try:
                results[i] = self.encoders.encode(token_ids, mm)
            except Exception as exc:
                results[i] = exc
        return results

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        if self._launched is not None and all(c.seq.is_finished for c in self._launched.chunks):
            self._launched = None  # nothing in flight is wanted; its KV writes precede any later step's
        return request_output(seq, "", [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._launched is not None

    def replays_next_step(self) -> bool:
        """The next step is a decode step whose batch a captured graph holds: no eager (compiled) code runs."""
        graphs = self.runner.graphs
        return (
            graphs is not None
            and self.scheduler.decodes_only
            and 0 < self.scheduler.num_running <= max(int_buckets(graphs.captured_buckets), default=0)
        )

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def stats(self) -> dict[str, int]:
        stats = {
            "num_waiting": self.scheduler.num_waiting,
            "num_running": self.scheduler.num_running,
            "kv_pages_total": self.pool.num_pages,
            "kv_pages_free": self.pool.num_free,
            "kv_pages_used": self.pool.num_used,
        }
        if self.device.type == "cuda":
            stats.update(allocator_stats(self.device))
        return stats

    # -- one step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if (
            self.decode_ahead
            and not self._launch_failed
            and may_run_ahead(self.scheduler, self._launched, _decodes_ahead)
        ):
            return self._step_ahead()
        if self._launched is not None:  # the next step needs the tokens of the one in flight
            launched, self._launched = self._launched, None
            return self._settle(launched)
        self._launch_failed = False
        step = self.scheduler.schedule()
        if not step.chunks:
            return []
        now = time.monotonic()
        for chunk in step.chunks:
            chunk.seq.data.metrics.setdefault("scheduled", now)
        return self._run(step.chunks)

    def _step_ahead(self) -> list[RequestOutput]:
        """Launch a decode step on the ids of the one in flight, then apply those (decode_ahead.py)."""
        previous, self._launched = self._launched, None
        step = self.scheduler.schedule()
        if previous is None and not (step.is_pure_decode and not step.preempted):
            return self._run(step.chunks)
        if step.is_pure_decode and not step.preempted:
            saved = [(g, g.get_state()) for g in _generators(step.chunks)]
            try:
                self._launched = self._launch(step.chunks, previous)
            except Exception:
                for generator, state in saved:  # the step runs again: its draws start where they stood
                    generator.set_state(state)
                if previous is None:  # run it again here, where a failure fails only the requests at fault
                    return self._run(step.chunks)
                log.warning(
                    "a decode step failed to launch ahead; it runs again after the step in flight",
                    exc_info=True,
                )
                self._launch_failed = True
        return self._settle(previous) if previous is not None else []

    def _launch(self, chunks: list[ScheduledChunk], previous: Launched | None) -> Launched:
        """Launch a decode step without waiting for its ids; its sequences get a placeholder token each."""
        rows = [_row(c.seq) for c in chunks]
        input_ids = previous.input_ids(chunks) if previous is not None else None
        launched = Launched.start(
            chunks, self.sampler(self.runner.execute(SchedulerOutput(chunks), input_ids), rows)
        )
        self.scheduler.update(SchedulerOutput(chunks), {c.seq.request_id: PLACEHOLDER for c in chunks})
        return launched

    def _settle(self, launched: Launched) -> list[RequestOutput]:
        """Read back a launched step's ids and apply them in place of its placeholders. A sequence finished
        since (stopped on an earlier token, aborted) drops its token."""
        try:
            tokens = launched.tokens()
        except Exception as exc:
            return [out for c in launched.chunks if not c.seq.is_finished for out in self._fail(c.seq, exc)]
        outputs = []
        for chunk, token in zip(launched.chunks, tokens):
            seq = chunk.seq
            if seq.is_finished:
                continue
            at = chunk.start + 1 - seq.num_prompt_tokens  # this token's index among the outputs
            later = seq.output_token_ids[at + 1 :]  # the placeholder of the step launched after this one
            seq.output_token_ids[at:] = [token]
            try:
                outputs.append(self._after_sample(seq, token))
            except Exception as exc:
                outputs += self._fail(seq, exc)
            if not seq.is_finished:
                seq.output_token_ids += later
        return outputs

    def _run(self, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        """Run `chunks` as one model step and apply what it sampled; a failure fails only the requests at
        fault (see isolation.run_isolated)."""
        return run_isolated(
            chunks,
            self._sample_step,
            self._apply,
            lambda chunk, exc: self._fail(chunk.seq, exc),
            _generators,
        )

    def _sample_step(self, chunks: list[ScheduledChunk]) -> list[int]:
        """The ids sampled after the chunks that end in a sample, in chunk order."""
        rows = [_row(c.seq) for c in chunks if c.samples]
        logits = self.runner.execute(SchedulerOutput(chunks))
        return self.sampler(logits, rows).tolist() if rows else []

    def _apply(self, chunks: list[ScheduledChunk], tokens: list[int]) -> list[RequestOutput]:
        sampling = [c for c in chunks if c.samples]
        self.scheduler.update(
            SchedulerOutput(chunks), {c.seq.request_id: t for c, t in zip(sampling, tokens)}
        )
        outputs = []
        for chunk, token in zip(sampling, tokens):
            try:
                outputs.append(self._after_sample(chunk.seq, token))
            except Exception as exc:
                outputs += self._fail(chunk.seq, exc)
        return outputs

    def _after_sample(self, seq: Sequence, token: int) -> RequestOutput:
        state: RequestState = seq.data
        if "first_token" not in state.metrics:
            state.metrics["first_token"] = time.monotonic()
        status, delta = stop_and_text(state, token)
        if status is not None:
            self.scheduler.finish(seq, status)
        if seq.is_finished and not state.detokenizer.stopped:
            delta += state.detokenizer.flush()
        return request_output(seq, delta, [token])

    def _fail(self, seq: Sequence, exc: Exception) -> list[RequestOutput]:
        """End `seq` with finish_reason "error" (a no-op on its status if it had just finished) and its error."""
        log.error("request %s failed", seq.request_id, exc_info=exc)
        seq.data.error = f"{type(exc).__name__}: {exc}"
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
        return [request_output(seq, "", [])]


def _decodes_ahead(seq: Sequence) -> bool:
    return seq.data.decodes_ahead


def _generators(chunks: list[ScheduledChunk]) -> list[torch.Generator]:
    """The seeded generators the sampling chunks draw from."""
    return [g for c in chunks if c.samples and (g := c.seq.data.generator) is not None]


def _row(seq: Sequence) -> SamplingRow:
    state: RequestState = seq.data
    return SamplingRow(
        params=state.params,
        token_ids=seq.prompt_token_ids,  # the output ids are the other half of what the repetition penalty reads
        output_token_ids=seq.output_token_ids,
        generator=state.generator,
        eos_token_ids=state.eos_token_ids,
    )
