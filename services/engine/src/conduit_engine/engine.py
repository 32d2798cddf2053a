"""The synchronous engine: validates and admits requests, runs schedule → execute → postprocess.

Not thread-safe by itself; `AsyncEngine` drives it from one thread.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conduit_engine.block_manager import BlockManager, BlockStats
from conduit_engine.config import EngineConfig
from conduit_engine.detokenizer import IncrementalDetokenizer
from conduit_engine.errors import DuplicateRequestError, InvalidRequestError, ModelLoadError, QueueFullError
from conduit_engine.model_runner import ModelRunner, SeqStepResult, kv_block_bytes
from conduit_engine.models.config import ArchConfig
from conduit_engine.models.loader import load_model, resolve_dtype
from conduit_engine.ops import get_ops
from conduit_engine.request import GenerationRequest, RequestOutput, Usage
from conduit_engine.sampling import TokenLogprobs
from conduit_engine.scheduler import Scheduler
from conduit_engine.sequence import FinishReason, Sequence
from conduit_engine.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)

_MAX_AUTO_BLOCKS_FACTOR = 2  # auto-sized caches hold at most this many full batches of full-length sequences


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    sent_first: bool = False
    pending_prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=len(self.prompt_token_ids),
            completion_tokens=sum(s.num_output_tokens for s in self.seqs),
            cached_tokens=self.seqs[0].num_cached_tokens,
        )


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    blocks: BlockStats
    finished_requests: int
    generated_tokens: int


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        folder = Path(config.model.path)
        if not folder.is_dir():
            raise ModelLoadError(f"model folder {folder} does not exist")
        self.model_name = config.model.served_name or folder.resolve().name
        self.arch = ArchConfig.from_folder(folder)
        self.tokenizer = ModelTokenizer(folder)
        self.eos_token_ids = _eos_ids(folder, self.arch)
        self.max_model_len = _max_model_len(config, self.arch)
        self.dtype = resolve_dtype(config.model.dtype, self.arch, config.model.device)
        torch.manual_seed(config.model.seed)
        ops = get_ops(config.model.device)
        model = load_model(folder, self.arch, ops, self.dtype, config.model.device, self.max_model_len)
        _set_cpu_threads(config.model.num_threads, model)
        self.block_size = config.cache.block_size
        self.num_blocks = self._num_blocks()
        self.runner = ModelRunner(
            model,
            self.arch,
            self.num_blocks,
            self.block_size,
            self.dtype,
            config.model.device,
            self.eos_token_ids,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_model_len=self.max_model_len,
            use_cuda_graphs=not config.enforce_eager,
        )
        self.block_manager = BlockManager(
            self.num_blocks, self.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self._requests: dict[str, _Request] = {}
        self._arrivals = itertools.count()
        self._finished_requests = 0
        self._generated_tokens = 0
        log.info(
            "loaded %s (%s, %s) on %s: %d KV blocks of %d tokens, max_model_len %d",
            self.model_name,
            self.arch.architecture,
            str(self.dtype).removeprefix("torch."),
            config.model.device,
            self.num_blocks,
            self.block_size,
            self.max_model_len,
        )

    # ----- requests --------------------------------------------------------------------------------
    def tokenize_prompt(self, req: GenerationRequest) -> list[int]:
        given = [x is not None for x in (req.text, req.token_ids, req.messages)]
        if sum(given) != 1:
            raise InvalidRequestError("input", "exactly one of text, token_ids or messages is required")
        if req.text is not None:
            if not req.text:
                raise InvalidRequestError("text", "prompt must not be empty")
            return self.tokenizer.encode(req.text)
        if req.messages is not None:
            return self.tokenizer.encode_chat(req.messages, req.add_generation_prompt)
        ids = list(req.token_ids or [])
        if not ids:
            raise InvalidRequestError("token_ids", "prompt must not be empty")
        vocab = self.arch.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise InvalidRequestError("token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        return ids

    def add_request(self, req: GenerationRequest) -> list[int]:
        """Validate and queue a request; returns its prompt token ids. Raises EngineError subclasses."""
        if req.request_id in self._requests:
            raise DuplicateRequestError("request_id", f"request {req.request_id!r} is already running")
        params = req.params
        params.validate(vocab_size=self.arch.vocab_size)
        prompt = self.tokenize_prompt(req)
        if not prompt:
            raise InvalidRequestError("input", "prompt encodes to no tokens")
        if params.max_tokens is None:
            # Until the context (or, for a small cache, the whole cache) is full.
            room = min(self.max_model_len, self.num_blocks * self.block_size)
            params.max_tokens = max(1, room - len(prompt))
        self._check_fits(prompt, params.max_tokens, params.n)
        self._check_queue(params.n)
        arrival = next(self._arrivals)
        seqs: list[Sequence] = []
        for index in range(params.n):
            seed = None if params.seed is None else params.seed + index
            seqs.append(
                Sequence(
                    request_id=req.request_id,
                    prompt_token_ids=prompt,
                    params=params,
                    index=index,
                    priority=req.priority,
                    arrival=arrival,
                    seed=seed,
                    parent=seqs[0] if seqs else None,
                )
            )
        detoks = [
            IncrementalDetokenizer(
                self.tokenizer.hf,
                prompt,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
            for _ in seqs
        ]
        self._requests[req.request_id] = _Request(req.request_id, prompt, seqs, detoks)
        log.info(
            "request %s queued: %d prompt tokens, n=%d, max_tokens=%d",
            req.request_id,
            len(prompt),
            params.n,
            params.max_tokens,
        )
        for seq in seqs:
            self.scheduler.add(seq)
        return prompt

    def _check_queue(self, num_new: int) -> None:
        # Sequences that can join the batch at the next step do not count as queued.
        sched = self.config.scheduler
        free_slots = max(0, sched.max_num_seqs - self.scheduler.num_running)
        if self.scheduler.num_waiting + num_new > sched.max_queued_requests + free_slots:
            raise QueueFullError(
                f"the waiting queue is full ({sched.max_queued_requests} queued requests); retry later"
            )

    def _check_fits(self, prompt: list[int], max_tokens: int, n: int) -> None:
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"prompt has {len(prompt)} tokens; the model's context is {self.max_model_len} "
                "tokens and at least one must remain for the completion",
            )
        total = len(prompt) + max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
                f"model's context of {self.max_model_len} tokens",
            )
        if self.block_manager.blocks_needed(total) > self.num_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt + max_tokens needs {self.block_manager.blocks_needed(total)} KV blocks but the "
                f"cache has {self.num_blocks}",
            )

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request; returns the final outputs of its unfinished choices (empty if unknown)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return []
        log.info("request %s aborted", request_id)
        outputs = []
        for seq in req.seqs:
            if seq.is_finished:
                continue
            seq.finish(FinishReason.ABORT)
            self.scheduler.finish(seq)
            outputs.append(self._output(req, seq, [], "", None, finished=True))
        self._finished_requests += 1
        return outputs

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ----- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        for seq in out.preempted:
            req = self._requests.get(seq.request_id)
            if req is not None and seq.index == 0 and not req.sent_first:
                # Its prompt is recomputed from position 0: the logprobs will come again.
                req.pending_prompt_logprobs.clear()
        results = self.runner.execute(out)
        self.scheduler.update_after_step(out)
        return self._postprocess(results)

    def _postprocess(self, results: list[SeqStepResult]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for result in results:
            seq = result.seq
            req = self._requests.get(seq.request_id)
            if req is None or seq.is_finished:
                continue
            if result.prompt_logprobs and seq.index == 0:  # choices share one prompt
                req.pending_prompt_logprobs.extend(result.prompt_logprobs)
            if result.token_id is None:
                continue
            self._generated_tokens += 1
            text = self._append(req, seq, result.token_id)
            if seq.is_finished:
                self.scheduler.finish(seq)
            logprobs = [result.logprobs] if result.logprobs is not None else []
            outputs.append(self._output(req, seq, [result.token_id], text, logprobs, seq.is_finished))
            if req.finished:
                del self._requests[req.request_id]
                self._finished_requests += 1
                usage = req.usage()
                log.info(
                    "request %s finished (%s): %d completion tokens, %d cached prompt tokens",
                    req.request_id,
                    ",".join(s.finish_reason.value for s in req.seqs if s.finish_reason is not None),
                    usage.completion_tokens,
                    usage.cached_tokens,
                )
        return outputs

    def _append(self, req: _Request, seq: Sequence, token_id: int) -> str:
        """Append a sampled token, apply the stop rules, and return the text it releases."""
        seq.append_token(token_id)
        params = seq.params
        detok = req.detokenizers[seq.index]
        can_stop = seq.num_output_tokens >= params.min_tokens
        if can_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            seq.stop_token_id = token_id
            seq.finish(FinishReason.STOP)
        elif can_stop and token_id in params.stop_token_ids:
            seq.stop_token_id = token_id
            seq.finish(FinishReason.STOP)
        if seq.is_finished and not params.include_stop_str_in_output:
            return detok.finish()
        delta = detok.step([token_id])
        text = delta.text
        if delta.stop_string is not None:
            seq.stop_string = delta.stop_string
            seq.finish(FinishReason.STOP)
            return text
        if seq.is_finished:
            return text + detok.finish()
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            text += detok.finish()
            # The held-back tail may complete a stop string only now: that is a stop, not a length.
            seq.stop_string = detok.stop_string
            seq.finish(FinishReason.STOP if detok.stop_string is not None else FinishReason.LENGTH)
        return text

    def _output(
        self,
        req: _Request,
        seq: Sequence,
        token_ids: list[int],
        text: str,
        logprobs: list[TokenLogprobs] | None,
        finished: bool,
    ) -> RequestOutput:
        out = RequestOutput(
            request_id=req.request_id,
            index=seq.index,
            text=text,
            token_ids=token_ids,
            usage=req.usage(),
            logprobs=logprobs or [],
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            stop_string=seq.stop_string if finished else None,
            stop_token_id=seq.stop_token_id if finished else None,
        )
        if not req.sent_first:
            req.sent_first = True
            out.prompt_token_ids = req.prompt_token_ids
            if seq.params.prompt_logprobs is not None:
                out.prompt_logprobs = list(req.pending_prompt_logprobs)
        return out

    # ----- introspection ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            running=len({s.request_id for s in self.scheduler.running}),
            waiting=len({s.request_id for s in self.scheduler.waiting}),
            blocks=self.block_manager.stats(),
            finished_requests=self._finished_requests,
            generated_tokens=self._generated_tokens,
        )

    def check_integrity(self) -> None:
        live = [s for r in self._requests.values() for s in r.seqs if not s.is_finished and s.block_table]
        self.block_manager.check_integrity(live)

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        per_block = kv_block_bytes(self.arch, self.block_size, self.dtype)
        if self.config.model.device == "cuda":
            free, _ = torch.cuda.mem_get_info()
            budget = int(free * cache.memory_fraction)
        else:
            budget = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * cache.memory_fraction)
        per_seq = (self.max_model_len + self.block_size - 1) // self.block_size
        cap = _MAX_AUTO_BLOCKS_FACTOR * self.config.scheduler.max_num_seqs * per_seq
        return max(per_seq, min(budget // per_block, cap))


_TINY_MODEL_PARAMS = 20_000_000


def _set_cpu_threads(requested: int, model: torch.nn.Module) -> None:
    """Intra-op threads only pay off for matrices big enough; for tiny models they just contend."""
    if requested > 0:
        torch.set_num_threads(requested)
    elif sum(p.numel() for p in model.parameters()) < _TINY_MODEL_PARAMS:
        torch.set_num_threads(1)


def _eos_ids(folder: Path, arch: ArchConfig) -> tuple[int, ...]:
    import json

    ids = list(arch.eos_token_ids)
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        for e in eos if isinstance(eos, list) else [eos]:
            if e is not None and e not in ids:
                ids.append(int(e))
    return tuple(ids)


def _max_model_len(config: EngineConfig, arch: ArchConfig) -> int:
    limit = arch.max_position_embeddings
    if arch.sliding_window is not None:
        limit = min(limit, arch.sliding_window)  # full attention is exact only inside the window
    requested = config.model.max_model_len
    if requested is None:
        return limit
    if requested > limit:
        raise ModelLoadError(f"--max-model-len {requested} exceeds the model's limit of {limit}")
    return requested
