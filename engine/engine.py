"""LLMEngine: wires scheduler, KV block manager, adapter manager, model runner, sampler and detokenizer.

Steps overlap (`EngineConfig.async_scheduling`, on by default on CUDA): `step()` schedules step N+1 and queues
its forward pass before it reads step N's sampled ids back, so the host's scheduling, input packing,
detokenizing and output work runs while the device computes. Step N's sequences feed N+1 their pending tokens
from the device (engine/runner.py); N+1's sampling stage is queued after N is read back, so its inputs (grammar
masks, penalties' counts, bad-word prefixes) see N's tokens. A sequence that stops at step N (EOS, a stop
string) has computed one more token at N+1, which is dropped.

Faults: a request whose sampled row has no valid distribution (non-finite logits, filters that leave no token;
engine/sampler.py reports it in the same copy as the ids) finishes alone with finish_reason "error". A step that
raises any other exception is contained: its batch is rolled back (`Scheduler.rollback`) and each of its requests
is retried alone for one sampled step; one that fails alone, or that is in MAX_FAILED_STEPS failed batches, finishes
with "error" (its KV blocks and adapter reference freed by `Scheduler.finish`), the others go on. Only a fault that
leaves the device unusable (a CUDA error) propagates out of `step()`.

Threads: `step()` runs in one engine thread; `add_request`, `abort_request`, `snapshot` and the adapter manager
are called from any thread. `_lock` guards the scheduler's queues; it is held while scheduling and
postprocessing, never during the forward pass or any file I/O (adapter I/O runs in callers' threads or in
the adapter manager's loader threads).
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

import torch

from kubelora.engine.adapters.manager import AdapterManager
from kubelora.engine.adapters.types import AdapterManagerConfig
from kubelora.engine.adapters.pool import DeviceLoRAPool
from kubelora.engine.adapters.staging import ShrinkStaging
from kubelora.engine.adapters.spec import AdapterLimits
from kubelora.engine.block_manager import BlockManager, BlockManagerConfig
from kubelora.contract.errors import FailureKind
from kubelora.engine.config import EngineConfig
from kubelora.engine.detokenizer import Detokenizer
from kubelora.engine.errors import InvalidRequest, PromptTooLong, QueueFull
from kubelora.engine.step.plan import plan_graphs, plan_warm_ups
from kubelora.engine.model.config import load_hf_config, model_config_from_hf
from kubelora.engine.model.llama import DecoderModel
from kubelora.engine.model.quantized import base_weights_info
from kubelora.engine.model.weights import extend_weights, load_weights, module_weight
from kubelora.engine.outputs import EngineSnapshot, LogprobsDecoder, RequestOutput
from kubelora.engine.prefix_key import root_key
from kubelora.engine.runner import LaunchedStep, ModelRunner, RunnerConfig, StepResult
from kubelora.engine.sampler import FAULT_NO_TOKEN_LEFT, FAULT_NON_FINITE_LOGITS
from kubelora.engine.sampling_batch import token_bitmask
from kubelora.engine.sampling_params import SamplingParams
from kubelora.engine.scheduler import Batch, Scheduler, SchedulerConfig
from kubelora.engine.sequence import Sequence, SequenceStatus
from kubelora.engine.step.shape import StepShape
from kubelora.engine.structured.compiler import GrammarCompiler
from kubelora.engine.structured.matcher import Advance, advance, new_matcher
from kubelora.engine import setup
from kubelora.engine.warmup import warm_up, warm_up_adapter_shape, warm_up_requests, warm_up_sizes

log = logging.getLogger(__name__)

IDLE_STEP_SLEEP_S = 0.002  # an empty step (requests only wait for adapter loads) yields the CPU briefly
MAX_FAILED_STEPS = 2  # a request in this many failed batches fails (it already passed a retry alone)
ROW_FAULTS = {  # the sampler's fault id -> (what the request is told, its FailureKind)
    FAULT_NON_FINITE_LOGITS: ("the model's logits for this request are not finite (NaN or Inf): its adapter's "
                              "weights or its input make the model diverge", FailureKind.NON_FINITE_LOGITS),
    FAULT_NO_TOKEN_LEFT: ("no token is left to sample: the request's sampling parameters (allowed_token_ids, "
                          "bad words, min_tokens, logit_bias, penalties, temperature) leave no finite logit",
                          FailureKind.NO_TOKEN_LEFT),
}


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.device = torch.device(config.device)
        self.dtype = setup.resolve_dtype(config)
        setup.configure_blas(self.device, self.config.blas_library)  # before the warm-up and the graphs pick their kernels
        hf_config = load_hf_config(config.model_dir)
        self.model_config = model_config_from_hf(hf_config, config.model_dir)
        self.model_name = config.served_model_name or self.model_config.name
        self.max_model_len = setup.resolve_max_model_len(config, self.model_config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
        self.eos_token_ids = _eos_ids(self.model_config.eos_token_ids, self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        torch.manual_seed(config.seed)
        # Seconds of each start-up phase (the log has them too): weights, warm_up, capture, warm_up_requests.
        self.startup_seconds: dict[str, float] = {}
        started = time.perf_counter()
        host_weights = load_weights(config.model_dir, self.model_config, self.dtype)
        self.base_weights = base_weights_info(self.model_config, host_weights)
        log.info("base weights: %s, %.2f GiB as stored", self.base_weights.format, self.base_weights.bytes / (1 << 30))
        # Staged shrinks: q/k/v and o weights inside taller buffers whose extra rows take adapters' A rows
        stage_buffers = {}
        if setup.uses_staged_shrink(config):
            rows = setup.staged_rows(config, self.model_config, self.dtype)
            stage_buffers = extend_weights(host_weights, rows, self.device)
        weights = host_weights.to(self.device)
        self.startup_seconds["weights"] = time.perf_counter() - started
        pool = DeviceLoRAPool(self.model_config, setup.pool_rows(config, self.model_config, self.dtype, self.device),
                              self.dtype, self.device)
        pool.set_base_weight(partial(module_weight, weights, self.model_config))  # DoRA's norms read W
        self._staging = None
        if stage_buffers:
            self._staging = ShrinkStaging(
                stage_buffers, {kind: weights.layers[0].weight[kind].shape[0] for kind in stage_buffers},
                {kind: self.model_config.kind_modules(kind) for kind in stage_buffers}, pool)
        self.adapters = AdapterManager(self._adapter_config(), self.model_config, pool, self._adapter_limits(pool))
        # Distinct adapters a batch can hold: the count limit, else what the pool holds at max_lora_rank.
        self.max_loras = config.max_loras or max(1, pool.num_rows // config.max_lora_rank)
        self.num_kv_blocks = setup.num_kv_blocks(config, self.model_config, self.dtype, self.max_model_len,
                                                 self.device)
        self._runner = self._build_runner(hf_config, weights, pool)
        self._blocks = BlockManager(BlockManagerConfig(self.num_kv_blocks, config.kv_block_size))
        self._scheduler = Scheduler(self._scheduler_config(), self._blocks, self.adapters)
        self._detokenizer = Detokenizer(self.tokenizer)
        self._logprobs = LogprobsDecoder(self.tokenizer)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._last_batch = (0, 0, 0)
        self._warmed_shapes: set[tuple[tuple[str, int], ...]] = set()  # see pending_warm_ups
        self._num_steps = 0
        self._is_async = setup.uses_async_scheduling(config)
        self._inflight: LaunchedStep | None = None  # launched, its sampled ids not read yet (engine thread only)
        self._suspects: list[Sequence] = []  # requests of a failed step, each retried alone (engine thread only)
        if self.device.type == "cuda":  # the step loop's own kernels load before the first request, not during it
            self.startup_seconds["warm_up_requests"] = warm_up_requests(self)
            log.info("warmed up the step loop in %.2f s", self.startup_seconds["warm_up_requests"])
            self._num_steps, self._last_batch = 0, (0, 0, 0)

    # ---- wiring ----

    def _adapter_config(self) -> AdapterManagerConfig:
        return AdapterManagerConfig(max_cpu_loras=self.config.max_cpu_loras,
                                    num_loader_threads=self.config.num_loader_threads,
                                    is_host_pinned=self.device.type == "cuda")

    def _adapter_limits(self, pool: DeviceLoRAPool) -> AdapterLimits:
        names = tuple(dict.fromkeys((self.model_name, self.model_config.name, str(self.config.model_dir))))
        return AdapterLimits(max_lora_rank=self.config.max_lora_rank, model_names=names,
                             is_base_model_strict=self.config.is_base_model_strict,
                             model_dir=str(self.config.model_dir),
                             base_format=self.base_weights.format if self.model_config.quantization else None)

    def _build_runner(self, hf_config, weights, pool: DeviceLoRAPool) -> ModelRunner:
        # One block past the scheduler's: the pad block padded rows of a static decode batch write into.
        kv_cache = setup.allocate_kv_cache(self.config, self.model_config, self.dtype, self.num_kv_blocks + 1,
                                           self.device)
        model = DecoderModel(self.model_config, weights,
                             setup.build_ropes(hf_config, self.model_config, self.max_model_len, self.device),
                             kv_cache, pool.layer_buffers(), use_gemv=self.config.use_gemv)
        lora_backend = setup.resolve_lora_backend(self.config)
        steps = setup.build_step_executor(self.config, model, self.max_model_len, self.num_kv_blocks, lora_backend,
                                          staging=self._staging)
        runner = ModelRunner(model, RunnerConfig(device=self.device, eos_token_ids=self.eos_token_ids), steps)
        if self.device.type == "cuda":  # compile before the first request, not during it
            seconds = warm_up(runner, warm_up_sizes(self.config.max_num_batched_tokens), self.num_kv_blocks,
                              self.config.max_lora_rank)
            log.info("warmed up the eager forward in %.1f s", seconds)
            self.startup_seconds["warm_up"] = seconds
        if steps.use_graphs:
            setup.capture_base(steps, self.device)
            self.startup_seconds["capture"] = steps.graphs.capture_seconds
        return runner

    def _scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.config.max_num_seqs,
                               max_num_batched_tokens=self.config.max_num_batched_tokens,
                               max_loras=self.config.max_loras, max_waiting=self.config.max_waiting,
                               eos_token_ids=self.eos_token_ids,
                               lora_time_slice_steps=self.config.lora_time_slice_steps)

    # ---- requests (any thread) ----

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    adapter: str | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None) -> None:
        """Queue a request. Raises InvalidRequest, PromptTooLong, QueueFull, UnknownAdapter, AdapterUnloading.

        cache_salt: requests share cached KV blocks only with requests of the same salt (and the same adapter
        revision), vLLM's field."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequest(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        prompt = self._check_prompt(prompt_token_ids)
        self._check_sampling_tokens(params)
        room = self.max_model_len - len(prompt)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        matcher = self._new_matcher(params)
        allowed = None
        if params.allowed_token_ids is not None:  # once here: steps copy the mask, never walk the list
            allowed = token_bitmask(params.allowed_token_ids, self.model_config.vocab_size)
        with self._lock:
            if self._scheduler.get(request_id) is not None:
                raise InvalidRequest(f"request_id {request_id!r} is already in flight")
            if not self._scheduler.has_room():
                raise QueueFull(self.config.max_waiting)
            revision = self.adapters.acquire(adapter) if adapter else None
            seq = Sequence(request_id=request_id, prompt_token_ids=prompt, params=params, adapter_name=adapter or None,
                           adapter=revision, max_tokens=max_tokens, arrival_time=arrival_time or time.time(),
                           generator=generator, grammar=matcher, allowed_bitmask=allowed,
                           cache_root=self._cache_root(revision, cache_salt))
            self._scheduler.add(seq)
            self._work.notify_all()

    def _cache_root(self, revision, cache_salt: str | None) -> bytes | None:
        """What a request's cached KV blocks are keyed under: its adapter's name and content revision (none for the
        base model) and its salt; None with prefix caching off."""
        if not self.config.enable_prefix_caching:
            return None
        if revision is None:
            return root_key(None, None, cache_salt)
        return root_key(revision.name, revision.spec.revision, cache_salt)

    def _new_matcher(self, params: SamplingParams):
        """A grammar matcher for a structured request; compiles here only if the caller did not (offline use)."""
        if params.structured is None:
            return None
        return new_matcher(params.structured.grammar or self.grammars.compile(params.structured))

    def abort_request(self, request_id: str) -> None:
        """Finish a request with "abort" (its output comes from the next step); unknown ids are ignored."""
        with self._lock:
            self._scheduler.abort(request_id)
            self._work.notify_all()

    def has_waiting_room(self) -> bool:
        with self._lock:
            return self._scheduler.has_room()

    def has_unfinished(self) -> bool:
        with self._lock:
            return self._has_work()

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block the engine thread until there is something to step (True) or the timeout passes."""
        with self._work:
            return self._work.wait_for(self._has_work, timeout)

    def _has_work(self) -> bool:
        return self._scheduler.has_unfinished() or self._inflight is not None

    # ---- one step (engine thread) ----

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the step whose sampled ids were read back."""
        if self._suspects:
            return self._step_alone(self._suspects[0])
        previous, outputs = self._inflight, []
        self._inflight = None
        with self._lock:
            for revision in self.adapters.take_retired():  # unloaded or replaced: its cached blocks go now
                self._blocks.drop(revision)
            batch = self._scheduler.schedule()
            outputs += [self._output(seq, []) for seq in self._scheduler.take_finished_between_steps()]
            self._count_step(batch)
        try:
            forward = self._runner.forward(batch, previous) if batch.chunks else None
        except Exception as exc:  # noqa: BLE001 - contained below unless the device is gone
            read, is_read = self._read_back(previous, [batch])
            return outputs + read + (self._contain([batch], exc) if is_read else [])
        read, is_read = self._read_back(previous, [batch])  # while the device runs this step's forward pass
        outputs += read
        if not is_read:  # this batch was fed from the failed step: rolled back with it
            return outputs
        if forward is None:
            if previous is None and not outputs:
                time.sleep(IDLE_STEP_SLEEP_S)
            return outputs
        # Sampling inputs come from the sequences' host state, the previous step's tokens included: grammar
        # matchers advanced, penalties' token counts, bad-word prefixes (only this thread changes those).
        try:
            launched = self._runner.sample(forward)
            if not self._is_async:
                launched.result()
        except Exception as exc:  # noqa: BLE001
            return outputs + self._contain([batch], exc)
        if self._is_async:
            self._inflight = launched
            return outputs
        with self._lock:
            return outputs + self._postprocess(launched)

    def _count_step(self, batch: Batch) -> None:
        if batch.chunks:
            self._last_batch = (len(batch.chunks), batch.num_tokens, len(batch.slots))
            self._num_steps += 1

    def _read_back(self, step: LaunchedStep | None, later: list[Batch]) -> tuple[list[RequestOutput], bool]:
        """Wait for a launched step's ids (outside the lock) and postprocess them; (outputs, whether it was read).
        If the wait fails, the step and the `later` batches fed from it are rolled back and contained together."""
        if step is None:
            return [], True
        try:
            step.result()
        except Exception as exc:  # noqa: BLE001
            return self._contain([step.batch, *later], exc), False
        with self._lock:
            return self._postprocess(step), True

    def _step_alone(self, seq: Sequence) -> list[RequestOutput]:
        """One step of a request of a failed batch, alone and read back at once: it fails if this step fails;
        once it has sampled a token it goes back to the shared batches."""
        with self._lock:
            outputs = [self._output(s, []) for s in self._scheduler.take_finished_between_steps()]
            batch = self._scheduler.schedule_alone(seq)
            self._count_step(batch)
        if not batch.chunks:  # finished, or preempted meanwhile: the scheduler takes it from here
            self._suspects.pop(0)
            return outputs
        try:
            launched = self._runner.execute(batch)
            launched.result()
        except Exception as exc:  # noqa: BLE001
            return outputs + self._contain([batch], exc)
        if batch.chunks[0].is_sampled:
            self._suspects.pop(0)
        with self._lock:
            return outputs + self._postprocess(launched)

    def _contain(self, batches: list[Batch], exc: Exception) -> list[RequestOutput]:
        """A step over `batches` raised: undo their scheduling; fail the requests that ran alone or have failed
        too often, retry the others alone. A device fault is re-raised: the engine cannot go on."""
        if _is_device_fault(exc):
            raise exc
        with self._lock:
            for batch in batches:
                self._scheduler.rollback(batch)
            seqs = list({c.seq.request_id: c.seq for b in batches for c in b.chunks
                         if not c.seq.status.is_finished}.values())
            log.error("a step of %d request(s) failed: %s", len(seqs), [s.request_id for s in seqs], exc_info=exc)
            self._suspects = [s for s in self._suspects if s not in seqs]
            outputs = []
            for seq in seqs:
                seq.num_failed_steps += 1
                if len(seqs) == 1 or seq.num_failed_steps >= MAX_FAILED_STEPS:
                    self._scheduler.finish(seq, SequenceStatus.FINISHED_ERROR, _step_error(exc),
                                           FailureKind.ENGINE_FAULT)
                    outputs.append(self._output(seq, []))
                else:
                    self._suspects.append(seq)
        return outputs

    def _postprocess(self, step: LaunchedStep) -> list[RequestOutput]:
        batch, result = step.batch, step.result()
        outputs = self._fail_row_faults(batch, result)
        for i, chunk in enumerate(batch.chunks):
            if not chunk.seq.status.is_finished:
                outputs += self._guarded(chunk.seq, lambda: self._record_chunk(chunk, i, result))
        updated = self._scheduler.postprocess(batch, result.sampled)
        for seq in updated:
            failed = self._guarded(seq, lambda: self._follow_token(seq))
            outputs += failed or [self._output(seq, seq.output_token_ids[-1:])]
        return outputs

    def _fail_row_faults(self, batch: Batch, result: StepResult) -> list[RequestOutput]:
        """Requests whose sampled row had no valid distribution finish with "error" (their token is dropped)."""
        outputs = []
        for chunk, token in zip(batch.chunks, result.sampled):
            if token is not None and token < 0 and not chunk.seq.status.is_finished:
                self._scheduler.finish(chunk.seq, SequenceStatus.FINISHED_ERROR, *ROW_FAULTS[token])
                outputs.append(self._output(chunk.seq, []))
        return outputs

    def _guarded(self, seq: Sequence, work) -> list[RequestOutput]:
        """Run one request's host work; if it raises, that request alone fails (a device fault propagates).
        Returns the failed request's output, or nothing."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001
            if _is_device_fault(exc):
                raise
            log.error("request %s failed after its step", seq.request_id, exc_info=exc)
            self._scheduler.finish(seq, SequenceStatus.FINISHED_ERROR, _step_error(exc), FailureKind.ENGINE_FAULT)
            return [self._output(seq, [])]
        return []

    def _follow_token(self, seq: Sequence) -> None:
        """The host work after a sequence's new token: its grammar, its text and stop strings."""
        if seq.grammar is not None:
            self._advance_grammar(seq)
        if self._detokenizer.update(seq, seq.status.is_finished):
            self._scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
            self._detokenizer.update(seq, True)

    def _advance_grammar(self, seq: Sequence) -> None:
        """Follow the sampled token; the request stops once its grammar has ended (it took the stop token)."""
        step = advance(seq.grammar, seq.output_token_ids[-1])
        if step is Advance.COMPLETED:
            self._scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        elif step is Advance.REJECTED:  # the sampler's mask makes this a bug
            self._scheduler.finish(seq, SequenceStatus.FINISHED_ERROR,
                                   f"token {seq.output_token_ids[-1]} is outside the request's grammar",
                                   FailureKind.ENGINE_FAULT)

    def _record_chunk(self, chunk, index: int, result: StepResult) -> None:
        """A chunk's kept logits, its sampled token's logprobs (appended with its token) and its prompt logprobs
        once per position."""
        seq = chunk.seq
        if result.logits[index] is not None:
            _record_logits(seq, chunk.start_pos, result.logits[index], chunk.is_sampled)
        if result.prompt_logprobs and result.prompt_logprobs[index]:
            for j, raw in enumerate(result.prompt_logprobs[index]):  # entry j is prompt token start_pos + 1 + j
                if chunk.start_pos + j == len(seq.prompt_logprobs):  # a preemption recomputes them
                    seq.prompt_logprobs.append(self._logprobs.position(raw))
        if result.logprobs and result.logprobs[index] is not None:
            seq.output_logprobs.append(self._logprobs.position(result.logprobs[index]))

    def _output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        finished = seq.status.is_finished
        keep_logits = finished and seq.params.return_logits
        params = seq.params
        has_logprobs = params.logprobs is not None and bool(new_token_ids)
        has_prompt_logprobs = params.prompt_logprobs is not None and (finished or len(seq.output_token_ids) == 1)
        return RequestOutput(
            request_id=seq.request_id,
            adapter=seq.adapter_name,
            new_token_ids=list(new_token_ids),
            token_ids=list(seq.output_token_ids),
            text=seq.text,
            finished=finished,
            finish_reason=seq.status.finish_reason,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_cached_tokens=seq.num_cached_tokens or 0,
            error=seq.error,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            first_scheduled_time=seq.first_scheduled_time,
            prompt_logits=torch.stack(seq.prompt_logits) if keep_logits and seq.prompt_logits else None,
            logits=torch.stack(seq.logits) if keep_logits and seq.logits else None,
            new_logprobs=tuple(seq.output_logprobs[-len(new_token_ids):]) if has_logprobs else (),
            logprobs=tuple(seq.output_logprobs) if finished and params.logprobs is not None else None,
            prompt_logprobs=tuple(seq.prompt_logprobs) if has_prompt_logprobs else None,
            error_kind=seq.error_kind,
        )

    def _check_sampling_tokens(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        bad = next((t for t in params.token_ids_used() if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} in the sampling parameters is outside the vocabulary [0, {vocab})")

    def _check_prompt(self, prompt_token_ids: list[int]) -> list[int]:
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise InvalidRequest("prompt must have at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise PromptTooLong(len(prompt), self.max_model_len)
        return prompt

    # ---- CUDA graphs for the registered adapters' shapes (engine thread, between steps) ----

    def pending_graphs(self) -> list[StepShape]:
        """Graphs that steps over the registered adapters will need and that are not captured: for the two most
        common adapter shapes (projection kinds, rank rounded to 16), their decode and prefill step shapes
        (engine/step/plan.py)."""
        return self._graph_plan()[0]

    def pending_warm_ups(self) -> list[tuple[tuple[str, int], ...]]:
        """Registered adapters' module ranks whose eager (prefill) LoRA kernels have not run yet (CUDA only):
        the most common MAX_WARM_SHAPES of them."""
        if self.device.type != "cuda":
            return []
        return plan_warm_ups(self.adapters.list(), self._warmed_shapes)

    def _graph_plan(self) -> tuple[list[StepShape], list[StepShape]]:
        return plan_graphs(self.adapters.list(), self.model_config, self._runner.steps)

    def capture_pending_graphs(self, budget_s: float = 0.25) -> bool:
        """Prefetch registered adapters into free pool rows, warm up pending adapter shapes' prefill kernels, then
        capture pending graphs, for up to budget_s (one of any at least); True while some remain. Only while no step
        is in flight: the engine thread calls it when it has no work."""
        started = time.perf_counter()
        # First, registered adapters into free pool rows (CUDA: a host -> device copy a first request would wait
        # for), one at a time: a request that arrives meanwhile waits for one adapter's copy at most. Being first,
        # it is done before the captures below, which /ready waits for.
        while self.device.type == "cuda" and not self._has_work() and self.adapters.prefetch_device(1):
            torch.cuda.synchronize(self.device)
            if time.perf_counter() - started >= budget_s:
                return True
        for ranks in self.pending_warm_ups():  # then the registered shapes' prefill kernels, one shape a slice
            if self._has_work():
                return True
            seconds = warm_up_adapter_shape(self._runner, warm_up_sizes(self.config.max_num_batched_tokens),
                                            self.num_kv_blocks, dict(ranks))
            self._warmed_shapes.add(ranks)
            log.info("warmed up the eager forward for adapter ranks %s in %.2f s", dict(ranks), seconds)
            if time.perf_counter() - started >= budget_s:
                return True
        pending, wanted = self._graph_plan()
        self._runner.steps.graphs.keep(wanted)  # shapes no longer common: their graphs go back to the LRU
        while pending and not self._has_work():
            self._runner.steps.capture_idle(pending.pop())
            if time.perf_counter() - started >= budget_s:
                break
        return bool(pending)

    # ---- observability ----

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            counts = self._scheduler.counts()
            kv_usage = self._blocks.usage
            last, steps, preemptions = self._last_batch, self._num_steps, self._scheduler.num_preemptions
            prefix_cache = dict(self._scheduler.prefix_cache_tokens)
        return EngineSnapshot.build(counts, last, kv_usage, self.num_kv_blocks, self.adapters.stats(),
                                    preemptions, steps, prefix_cache)

    def close(self) -> None:
        self.adapters.close()
        self.grammars.close()


def _is_device_fault(exc: BaseException) -> bool:
    """A CUDA error leaves the context unusable (every later call fails): no request can be served after it."""
    return isinstance(exc, torch.AcceleratorError) or (isinstance(exc, RuntimeError) and "CUDA error" in str(exc))


def _step_error(exc: BaseException) -> str:
    """What a request failed by a step's exception is told (the traceback goes to the engine log only)."""
    return f"the engine failed while running this request ({type(exc).__name__}); see the engine log"


def _record_logits(seq: Sequence, start_pos: int, logits: torch.Tensor, is_sampled: bool) -> None:
    """Keep prompt-position logits once (a preemption recomputes them) and the sampled step's logits."""
    num_prompt = len(seq.prompt_token_ids)
    for i in range(logits.shape[0]):
        if start_pos + i == len(seq.prompt_logits) < num_prompt:
            seq.prompt_logits.append(logits[i])
    if is_sampled:
        seq.logits.append(logits[-1])


def _eos_ids(model_eos: tuple[int, ...], tokenizer) -> tuple[int, ...]:
    ids = list(model_eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)
