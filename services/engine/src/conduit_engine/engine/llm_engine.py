"""The synchronous engine: admits requests and runs each step as schedule → execute → update.

What the model is comes from `models.facts`, how a step reaches it from the executor
(`executor.factory`), request validation from `admission`, what a sampled token does to its choice
from `output_processor`, the two sides of disaggregated requests from `kv_transfer` (the producer ends a
prefill at its first token with the prompt's KV pinned; the consumer starts a decode from pulled KV).
Not thread-safe by itself; `AsyncEngine` drives it from one thread. What it reports about its work goes
to the attached `observer.EngineObserver`s (metrics, tracing), if any.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conduit_common.logs import request_extra
from conduit_engine.config import EngineConfig
from conduit_engine.core.block_manager import BlockManager, BlockStats
from conduit_engine.core.scheduler import Scheduler
from conduit_engine.core.scheduler_output import SchedulerOutput
from conduit_engine.core.sequence import FinishReason, Sequence, lora_prefix_root
from conduit_engine.core.spec_decode import SpecDecodeCounters
from conduit_engine.core.stop_rules import StopRules
from conduit_engine.engine.admission import Admission, Limits
from conduit_engine.engine.continuation import check_continuation, replay_continuation
from conduit_engine.engine.detokenizer import IncrementalDetokenizer
from conduit_engine.engine.kv_events import KvEventPublisher
from conduit_engine.engine.observer import EngineObserver, StepRecord, StepTimer, clock, request_record
from conduit_engine.engine.output_processor import accept_token
from conduit_engine.engine.request import GenerationRequest, RequestOutput
from conduit_engine.engine.request_state import RequestState
from conduit_engine.errors import FailedPreconditionError, InvalidRequestError, NotFoundError
from conduit_engine.executor.factory import build_executor
from conduit_engine.executor.step_batch import SeqStepResult
from conduit_engine.kv_format import kv_element_dtype
from conduit_engine.kv_transfer.cache_io import KvBlockStore
from conduit_engine.kv_transfer.checks import KvTransferLimits, check_transfer_request
from conduit_engine.kv_transfer.consumer import KvConsumer, PendingPull, replay_first_tokens
from conduit_engine.kv_transfer.layout import KvLayoutSpec
from conduit_engine.kv_transfer.producer import KvProducer
from conduit_engine.kv_transfer.registry import KvTransferRegistry
from conduit_engine.kv_transfer.service import KvTransferService, RunOnEngine
from conduit_engine.kv_transfer.setup import start_transports
from conduit_engine.kv_transfer.transport import KvPullResult
from conduit_engine.models.facts import ModelFacts, describe
from conduit_engine.models.prompt_bound import prompt_bound
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.structured.requests import StructuredOutputs

if TYPE_CHECKING:
    from conduit_engine.executor.worker_group import WorkerGroup
    from conduit_engine.lora.manager import AdapterInfo, LoraManager
    from conduit_engine.structured.compiler import CompiledStructure
    from conduit_engine.structured.spec import StructuredSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    blocks: BlockStats
    finished_requests: int
    generated_tokens: int
    kv_transfers_pending: int = 0  # produced here, not yet pulled, released or expired
    kv_bytes_pulled: int = 0
    kv_bytes_saved: int = 0  # not pulled: already in this engine's prefix cache
    kv_pulls: int = 0  # pulls into this engine that completed
    spec_decode: SpecDecodeCounters | None = None  # speculative decoding's totals; None: it is off
    lora_adapters: list[str] = field(default_factory=list)  # the LoRA adapters served
    lora_in_memory: list[str] = field(default_factory=list)  # those whose weights are loaded now
    lora_running: dict[str, int] = field(default_factory=dict)  # adapter → requests in the running batch
    lora_waiting: dict[str, int] = field(default_factory=dict)  # adapter → requests waiting
    max_loras: int = 0  # adapters one batch may mix (0: LoRA off)


class LLMEngine:
    def __init__(self, config: EngineConfig, workers: WorkerGroup | None = None) -> None:
        """`workers`: worker processes spawned beforehand (the server spawns them before gRPC starts);
        with --tensor-parallel-size > 1 or --worker-process and None, they are spawned here."""
        self.config = config
        facts = describe(config)
        self.model_name = facts.name
        self.arch = facts.arch
        self.tokenizer = facts.tokenizer
        self.eos_token_ids = facts.eos_token_ids
        self.max_model_len = facts.max_model_len
        self.dtype = facts.dtype
        self.block_size = config.cache.block_size
        self.executor, self.num_blocks = build_executor(config, facts, workers)
        try:
            self._init_core(config, facts)
        except BaseException:
            self.executor.shutdown()  # no worker outlives an engine that failed to start
            raise

    def _init_core(self, config: EngineConfig, facts: ModelFacts) -> None:
        self.block_manager = BlockManager(
            self.num_blocks,
            self.block_size,
            config.cache.enable_prefix_caching,
            sliding_window=self.arch.uniform_window,  # blocks behind it are freed as sequences grow
        )
        # Prefix-cache events for SubscribeKvEvents (published by the loop thread after each step).
        self.kv_events = KvEventPublisher(self.block_manager)
        # The adapters (--enable-lora): served names, loaded weights, pool slots.
        self.lora: LoraManager | None = getattr(self.executor, "lora", None)
        self._lora_roots: dict[str, bytes] = {}
        self._lora_loads = itertools.count()
        for name in self.lora.names() if self.lora is not None else ():
            self._lora_roots[name] = lora_prefix_root(name, next(self._lora_loads))
        max_loras = config.lora.max_loras if self.lora is not None else 0
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_manager,
            self.max_model_len,
            self.executor.multi_pass,
            speculative=config.speculative,
            max_loras=max_loras,
        )
        self.stop_rules = StopRules(self.eos_token_ids, self.max_model_len)
        limits = Limits(self.arch.vocab_size, self.max_model_len, self.num_blocks, self.block_size)
        self.prompt_bound = prompt_bound(self.tokenizer.hf, self.max_model_len)
        log.info("%s", self.prompt_bound.describe())
        self.admission = Admission(
            self.tokenizer,
            limits,
            self.scheduler,
            config.scheduler,
            facts.generation_defaults,
            self.prompt_bound,
        )
        self.structured = StructuredOutputs(self.tokenizer.hf, self.arch.vocab_size, self.eos_token_ids)
        self._init_kv_transfer()
        self._requests: dict[str, RequestState] = {}
        self._arrivals = itertools.count()
        self._finished_requests = 0
        self._generated_tokens = 0
        self._log_prompts = config.telemetry.log_prompts
        # What speculative decoding's gate measures a step's cost with: this process's CPU time when the
        # model runs here (other processes' load on a shared machine stretches wall time, not it), wall
        # time when the model runs in worker processes.
        self._spec_clock = time.process_time if self.executor.multi_pass else time.perf_counter
        # Attach on the engine thread (AsyncEngine.run_sync), between steps.
        self.observers: list[EngineObserver] = []
        log.info(
            "loaded %s (%s, %s) on %s%s: %d KV blocks of %d tokens, max_model_len %d",
            self.model_name,
            self.arch.architecture,
            self.dtype,
            config.model.device,
            _placement(config),
            self.num_blocks,
            self.block_size,
            self.max_model_len,
        )

    def _init_kv_transfer(self) -> None:
        config = self.config.disaggregation
        # The payload layout every executor's gather/scatter uses: all of the model's KV heads.
        arch = self.arch
        dtype = kv_element_dtype(self.dtype, self.config.cache.kv_cache_dtype)
        self.kv_layout = KvLayoutSpec(
            self.model_name, dtype, self.block_size, arch.num_layers, arch.num_kv_heads, arch.head_dim
        )
        self.kv_registry = KvTransferRegistry(self.block_manager, config.lease_seconds)
        self.kv_producer = KvProducer(self.kv_registry)
        self.kv_consumer = KvConsumer(self.block_manager, self.kv_layout)
        self.kv_transports = start_transports(config.kv_transport, self.executor, config.pull_timeout_seconds)
        window = self.arch.uniform_window
        self.kv_limits = KvTransferLimits(config, self.kv_layout, self.arch.vocab_size, window)

    # ----- requests --------------------------------------------------------------------------------
    def add_request(
        self,
        req: GenerationRequest,
        structure: CompiledStructure | None = None,
        prompt: list[int] | None = None,
    ) -> list[int]:
        """Admit and queue a request; returns its prompt token ids. Raises EngineError subclasses.

        `prompt`: its ids from `admission.prompt_token_ids(req)`, when the caller tokenized it off the
        step loop (AsyncEngine does); otherwise it is tokenized here.

        `structure`: the request's compiled output structure, when the caller compiled it off the step
        loop (AsyncEngine does); otherwise it is compiled here, synchronously. A consume request is not
        queued yet: its pull is pending (`kv_consumer.pending`) until `finish_pull`.
        """
        root = self._lora_root(req.lora)
        admitted = self.admission.admit(req, self._requests, prompt)
        params, prompt = admitted.params, admitted.prompt_token_ids
        check_transfer_request(req.kv_produce, req.kv_consume, params.n, len(prompt), self.kv_limits)
        if req.kv_consume is not None and req.kv_consume.handle.lora_name != req.lora:
            raise InvalidRequestError(
                "kv_transfer.consume.handle.lora_name",
                f"the KV was computed with {_adapter(req.kv_consume.handle.lora_name)}, "
                f"the request runs {_adapter(req.lora)}",
            )
        spec = params.structured
        if spec is not None and structure is None:
            structure = self.structured.compile_now(spec)
        consume, continuation = req.kv_consume, req.continuation
        if continuation is not None:
            check_continuation(continuation, params.n, self.arch.vocab_size)
            indices = continuation.choice_indices
        else:
            indices = consume.choice_indices if consume is not None else list(range(params.n))
        seqs = self._sequences(req.request_id, prompt, params, admitted.priority, indices)
        for seq in seqs:
            seq.lora_name, seq.lora_root = req.lora, root
        if spec is not None and structure is not None:
            for seq, grammar in zip(
                seqs, self.structured.states(spec, structure, prompt, len(seqs)), strict=True
            ):
                seq.grammar = grammar
        state = RequestState(
            req.request_id,
            prompt,
            seqs,
            {seq.index: self._detokenizer(prompt, params) for seq in seqs},
            kv_produce=req.kv_produce,
            arrival=clock() if req.arrival_time is None else req.arrival_time,
            trace_context=req.trace_context,
        )
        accept = self._replay_accept(state)
        if continuation is not None:
            replay_continuation(continuation, seqs, accept)
        if consume is not None:
            replay_first_tokens(consume, seqs, accept)
            self.kv_consumer.start(req.request_id, consume.handle, seqs, req.trace_context)
        self._requests[req.request_id] = state
        log.info(
            "request %s queued: %d prompt tokens, n=%d, max_tokens=%d%s%s",
            req.request_id,
            len(prompt),
            params.n,
            params.max_tokens,
            _side(req),
            f", prompt {self.tokenizer.decode(prompt, False)!r}" if self._log_prompts else "",
            extra=request_extra(req.request_id),
        )
        if consume is None:
            for seq in seqs:  # each holds its cached prefix while it waits (Scheduler.add)
                self.scheduler.add(seq)
        return prompt

    def _lora_root(self, name: str | None) -> bytes | None:
        if name is None:
            return None
        root = self._lora_roots.get(name)
        if root is None:
            raise InvalidRequestError("model", f"no LoRA adapter {name!r} is loaded on this engine")
        return root

    # ----- LoRA adapters -----------------------------------------------------------------------------
    def load_lora(self, name: str, path: str) -> AdapterInfo:
        """Serve the adapter at `path` (a folder or a Hub id) as `name`. Raises InvalidRequestError."""
        manager = self._lora_manager()
        if name == self.model_name:
            raise InvalidRequestError("lora_name", f"{name!r} is the base model's name")
        info = manager.load(name, path)
        self._lora_roots[name] = lora_prefix_root(name, next(self._lora_loads))
        return info

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name`; refused while requests of it are in flight."""
        manager = self._lora_manager()
        if not manager.has(name):
            raise NotFoundError(f"lora_name: no LoRA adapter {name!r} is loaded on this engine")
        busy = [r for r in self._requests.values() if any(s.lora_name == name for s in r.seqs)]
        if busy:
            raise FailedPreconditionError(
                f"lora_name: adapter {name!r} has {len(busy)} request(s) in flight; unload it after them"
            )
        manager.unload(name)
        del self._lora_roots[name]

    def list_loras(self) -> list[AdapterInfo]:
        return [] if self.lora is None else self.lora.list()

    def lora_requests(self) -> tuple[dict[str, int], dict[str, int]]:
        """Requests per adapter: (running, waiting)."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for seqs, counts in ((self.scheduler.running, running), (self.scheduler.waiting, waiting)):
            for _, name in {(s.request_id, s.lora_name) for s in seqs if s.lora_name}:
                counts[name] = counts.get(name, 0) + 1
        return running, waiting

    def _lora_manager(self) -> LoraManager:
        if self.lora is None:
            raise FailedPreconditionError(
                "LoRA adapters are not enabled on this engine (start it with --enable-lora)"
            )
        return self.lora

    def _replay_accept(self, state: RequestState) -> Callable[[Sequence, int], str]:
        """The token update for tokens sampled elsewhere (a consumed first token, a continuation): applied
        like a token sampled here, but not counted as generated by this engine."""
        return lambda seq, token_id: accept_token(
            seq, token_id, state.detokenizers[seq.index], self.stop_rules
        )

    def _sequences(
        self, request_id: str, prompt: list[int], params: SamplingParams, priority: int, indices: list[int]
    ) -> list[Sequence]:
        """The choices `indices` of a request; the first computes the shared prompt, the others wait."""
        arrival = next(self._arrivals)
        seqs: list[Sequence] = []
        for index in indices:
            seqs.append(
                Sequence(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    params=params,
                    index=index,
                    priority=priority,
                    arrival=arrival,
                    seed=None if params.seed is None else params.seed + index,
                    parent=seqs[0] if seqs else None,
                )
            )
        return seqs

    def _detokenizer(self, prompt: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer.hf,
            prompt,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request; returns the final outputs of its unfinished choices (empty if unknown)."""
        if request_id in self._requests:
            log.info("request %s aborted", request_id, extra=request_extra(request_id))
        return self._end(request_id, FinishReason.ABORT)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every live request with FinishReason.ERROR (the step failed); frees all their blocks."""
        outputs: list[RequestOutput] = []
        for request_id in list(self._requests):
            log.error("request %s failed: %s", request_id, error, extra=request_extra(request_id))
            outputs.extend(self._end(request_id, FinishReason.ERROR, error))
        return outputs

    def migrate_all(self) -> list[RequestOutput]:
        """Hand every live request back unfinished (FinishReason.MIGRATE: the engine is draining and its
        callers continue the choices elsewhere); frees all their blocks."""
        outputs: list[RequestOutput] = []
        for request_id in list(self._requests):
            log.info("request %s handed back for migration", request_id, extra=request_extra(request_id))
            outputs.extend(self._end(request_id, FinishReason.MIGRATE))
        return outputs

    def _end(self, request_id: str, reason: FinishReason, error: str | None = None) -> list[RequestOutput]:
        req = self._requests.pop(request_id, None)
        if req is None:
            return []
        held = self.kv_consumer.orphan(request_id)  # a running pull still writes into its blocks
        outputs = []
        for seq in req.seqs:
            if seq.is_finished:
                continue
            seq.finish(reason)
            if seq is not held:
                self.scheduler.finish(seq)
            outputs.append(req.output(seq, [], "", [], error))
        if req.kv_produce:
            self.kv_producer.request_ended(req, completed=False)
        self._finished_requests += 1
        self._report_request(req, reason)
        return outputs

    # ----- disaggregation ----------------------------------------------------------------------------
    def finish_pull(self, request_id: str, result: KvPullResult | None) -> None:
        """A consume request's pull ended (None: it failed, the prompt is recomputed here): queue its
        choices, or free the blocks of a request that ended meanwhile."""
        for seq in self.kv_consumer.finish(request_id, result):
            self.scheduler.add(seq)

    def expire_kv_transfers(self) -> None:
        """Free the blocks of produced transfers whose lease ran out (the loop calls this between steps)."""
        for transfer_id in self.kv_registry.expire_due():
            log.info("KV transfer %s expired before anyone pulled it", transfer_id)

    def pending_pull(self, request_id: str) -> PendingPull | None:
        """The KV pull a consume request waits for (None: no pull, or it already ended)."""
        return self.kv_consumer.pending(request_id)

    def kv_transfer_service(self, run_on_engine: RunOnEngine, max_message_bytes: int) -> KvTransferService:
        """PullKv / ReleaseKv over this engine's produced transfers and KV cache; registry calls go through
        `run_on_engine` (the engine loop thread)."""
        return KvTransferService(
            self.kv_registry,
            self.executor,
            self.kv_layout,
            run_on_engine=run_on_engine,
            chunk_bytes=self.config.disaggregation.chunk_bytes,
            max_message_bytes=max_message_bytes,
            serve_shm=bool(self.kv_transports.offered.shm_host),
            shm_cache=self.kv_transports.shm_cache,
            nixl=self.kv_transports.nixl,
        )

    @property
    def kv_store(self) -> KvBlockStore:
        """This engine's KV cache blocks, for pulls into it (any thread, blocks no step touches)."""
        return self.executor

    def compile_structure(self, spec: StructuredSpec) -> Awaitable[CompiledStructure]:
        """Compile a request's output structure off the step loop (a thread; cached)."""
        return self.structured.compile(spec)

    def on_executor_failure(self, listener: Callable[[], None]) -> None:
        """Call `listener` (from any thread) when the executor fails (a worker process died)."""
        self.executor.on_failure(listener)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def executor_failure(self) -> str | None:
        """Why the model cannot run any more (a worker process failed), or None."""
        return self.executor.failure()

    def shutdown(self) -> None:
        """Stop compiling grammars, release every produced KV transfer and stop the executor's worker
        processes, if any (idempotent; after the loop stopped stepping)."""
        self.structured.shutdown()
        self.kv_registry.release_all()
        self.executor.shutdown()

    # ----- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = self._spec_clock()
        timer = StepTimer(self.observers)
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        pure_decode = scheduled.num_prefill_tokens == 0 and not scheduled.preempted
        timer.scheduled(scheduled, self._requests)
        # What scheduling evicted reaches the routers now, not after the model ran: a request routed
        # during this step must not be sent here for blocks that are already gone.
        self.kv_events.publish()
        results = self.executor.execute(scheduled)
        self.scheduler.observe(scheduled, timer.executed(scheduled))
        outputs = self._update(scheduled, results, timer.record)
        spec = self.scheduler.spec
        if spec is not None and pure_decode:
            emitted = sum(len(out.token_ids) for out in outputs)
            seconds = self._spec_clock() - started
            spec.observe_step(len(scheduled.scheduled), scheduled.num_spec_tokens > 0, seconds, emitted)
        timer.finish()
        return outputs

    def _update(
        self, scheduled: SchedulerOutput, results: list[SeqStepResult], record: StepRecord | None
    ) -> list[RequestOutput]:
        """The one update loop, for one token per sequence or several (a multi-pass step): advance each
        sequence's computed tokens, put its tokens through `_accept` one at a time (those after a stop
        are dropped, with their KV), and free what finished. One output per sequence with tokens."""
        for seq in scheduled.preempted:
            req = self._requests.get(seq.request_id)
            if req is not None and seq.index == 0 and not req.sent_first:
                # Its prompt is recomputed from position 0: the logprobs will come again.
                req.pending_prompt_logprobs.clear()
        outputs: list[RequestOutput] = []
        for item, result in zip(scheduled.scheduled, results, strict=True):
            seq = item.seq
            computed_before = seq.num_computed_tokens
            self.scheduler.advance(seq, item.num_new_tokens)  # the KV the step's first pass computed
            req = self._requests.get(seq.request_id)
            if req is None or seq.is_finished:
                continue
            if result.prompt_logprobs and seq.index == 0:  # choices share one prompt
                req.pending_prompt_logprobs.extend(result.prompt_logprobs)
            if item.spec_token_ids and self.scheduler.spec is not None:
                # The tokens kept beyond the first are accepted proposal tokens (step_batch.verify).
                drafts, kept = len(item.spec_token_ids), len(result.token_ids) - 1
                self.scheduler.spec.observe(seq, drafts, kept, computed_before)
            accepted: list[int] = []
            text = ""
            for token_id in result.token_ids:
                if seq.is_finished:
                    break  # a stop came earlier in this step: the rest is dropped
                if accepted:
                    self.scheduler.advance(seq, 1)  # the KV of the token the pass before sampled
                text += self._accept(req, seq, token_id, record)
                accepted.append(token_id)
            if not accepted:
                continue
            handoff = self.kv_producer.after_first_token(req, seq) if req.kv_produce else None
            if seq.is_finished:
                self.scheduler.finish(seq)  # its blocks, those of any dropped tokens included
            logprobs = result.logprobs[: len(accepted)]
            outputs.append(req.output(seq, accepted, text, logprobs, kv_transfer=handoff))
            if req.finished:
                self._retire(req)
        return outputs

    def _accept(self, req: RequestState, seq: Sequence, token_id: int, record: StepRecord | None) -> str:
        """Count a sampled token and apply it to its choice (append, grammar, stops, detokenization);
        the text it releases."""
        self._generated_tokens += 1
        if record is not None:
            record.token(req, seq)
        return accept_token(seq, token_id, req.detokenizers[seq.index], self.stop_rules)

    def _retire(self, req: RequestState) -> None:
        del self._requests[req.request_id]
        if req.kv_produce:
            self.kv_producer.request_ended(req, completed=True)
        self._finished_requests += 1
        usage = req.usage()
        log.info(
            "request %s finished (%s): %d completion tokens, %d cached prompt tokens%s",
            req.request_id,
            ",".join(s.finish_reason.value for s in req.seqs if s.finish_reason is not None),
            usage.completion_tokens,
            usage.cached_tokens,
            f", completion {[d.output_text for d in req.detokenizers.values()]!r}"
            if self._log_prompts
            else "",
            extra=request_extra(req.request_id),
        )
        self._report_request(req, None)

    def _report_request(self, req: RequestState, reason: FinishReason | None) -> None:
        if self.observers:
            record = request_record(req, reason, clock())
            for observer in self.observers:
                observer.on_request_end(record)

    # ----- introspection ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        lora_running, lora_waiting = self.lora_requests()
        adapters = self.list_loras()
        return EngineStats(
            running=len({s.request_id for s in self.scheduler.running}),
            waiting=len({s.request_id for s in self.scheduler.waiting}),
            blocks=self.block_manager.stats(),
            finished_requests=self._finished_requests,
            generated_tokens=self._generated_tokens,
            kv_transfers_pending=self.kv_registry.num_pending,
            kv_bytes_pulled=self.kv_consumer.counters.bytes_pulled,
            kv_bytes_saved=self.kv_consumer.counters.bytes_saved,
            kv_pulls=self.kv_consumer.counters.pulls,
            spec_decode=None if self.scheduler.spec is None else self.scheduler.spec.counters.copy(),
            lora_adapters=[a.name for a in adapters],
            lora_in_memory=[a.name for a in adapters if a.loaded],
            lora_running=lora_running,
            lora_waiting=lora_waiting,
            max_loras=0 if self.lora is None else self.lora.max_loras,
        )

    def check_integrity(self) -> None:
        live = [s for r in self._requests.values() for s in r.seqs if not s.is_finished and s.block_table]
        live += [s for s in self.kv_consumer.held_sequences() if s not in live]
        self.block_manager.check_integrity(live)
        self.kv_registry.check_integrity()


def _adapter(name: str | None) -> str:
    return "the base model" if name is None else f"LoRA adapter {name!r}"


def _side(req: GenerationRequest) -> str:
    """What the queued-request log line says about a request that is not a whole new one."""
    if req.kv_produce:
        return " (prefill: KV hand-off)"
    if req.kv_consume is not None:
        return " (decode: KV pull)"
    if req.continuation is not None:
        tokens = sum(len(choice.token_ids) for choice in req.continuation.choices)
        return f" (continuation of {len(req.continuation.choices)} choice(s), {tokens} tokens)"
    return ""


def _placement(config: EngineConfig) -> str:
    parallel = config.parallel
    if parallel.tensor_parallel_size > 1:
        return f" in {parallel.tensor_parallel_size} tensor-parallel worker processes"
    return " in a worker process" if parallel.worker_process else ""
