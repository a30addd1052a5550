"""What the engine hands back: per-step request outputs, offline results, and a metrics snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kubelora.engine.adapters.types import AdapterStats
from kubelora.contract.errors import FailureKind


@dataclass(frozen=True)
class Logprob:
    token_id: int
    logprob: float  # natural log; -inf is reported as sampler.LOGPROB_FLOOR
    token: str  # the token decoded alone


@dataclass(frozen=True)
class PositionLogprobs:
    """One position of a prompt or an output: the token there and the most likely ones (most likely first)."""

    chosen: Logprob
    top: tuple[Logprob, ...]


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    adapter: str | None
    new_token_ids: list[int]  # generated this step
    token_ids: list[int]  # all generated so far
    text: str  # full stable text so far (stop strings removed)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    num_prompt_tokens: int
    error: str | None  # set with finish_reason "error" (e.g. the adapter's on-demand load failed)
    arrival_time: float  # time.time() of add_request
    first_token_time: float | None  # time.time() of the first generated token (TTFT = this - arrival_time)
    # time.time() of the first step that computed part of its prompt: arrival -> this is the time queued (waiting
    # for admission, an adapter load, KV room), this -> first_token_time the prefill
    first_scheduled_time: float | None = None
    prompt_logits: torch.Tensor | None = None  # [num_prompt_tokens, vocab], finished + return_logits only
    logits: torch.Tensor | None = None  # [num_generated, vocab]: the distribution of each generated token
    # With params.logprobs: one per token of new_token_ids; every one so far once finished.
    new_logprobs: tuple[PositionLogprobs, ...] = ()
    logprobs: tuple[PositionLogprobs, ...] | None = None
    # With params.prompt_logprobs: one per prompt token after the first; on the first token's output and
    # once finished.
    prompt_logprobs: tuple[PositionLogprobs, ...] | None = None
    error_kind: FailureKind | None = None  # set with finish_reason "error", as `error` is
    num_cached_tokens: int = 0  # prompt tokens whose KV its admission found in the prefix cache


@dataclass(frozen=True)
class GenerationResult:
    """One prompt's result from `LLM.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    adapter: str | None
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None
    prompt_logits: torch.Tensor | None
    logits: torch.Tensor | None
    logprobs: tuple[PositionLogprobs, ...] | None = None
    prompt_logprobs: tuple[PositionLogprobs, ...] | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache


class LogprobsDecoder:
    """The sampler's token-id logprobs with each token's text (decoded alone, cached per id)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def position(self, raw) -> PositionLogprobs:
        """raw: a sampler.TokenLogprobs."""
        top = tuple(Logprob(t, lp, self._text(t)) for t, lp in zip(raw.top_ids, raw.top_logprobs))
        return PositionLogprobs(Logprob(raw.token_id, raw.logprob, self._text(raw.token_id)), top)

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


@dataclass(frozen=True)
class EngineSnapshot:
    """Point-in-time engine state for metrics. Adapter keys: the adapter name, "" for the base model."""

    num_running: dict[str, int]
    num_waiting: dict[str, int]
    last_batch_size: int  # sequences in the last step
    last_batch_tokens: int
    last_batch_adapters: int  # distinct adapters in the last step
    kv_cache_usage: float  # fraction of KV blocks in use
    num_kv_blocks: int
    adapter_pool_used_bytes: int
    adapter_pool_total_bytes: int
    adapter_host_bytes: int
    num_adapter_loads: int
    num_adapter_load_failures: int
    num_device_evictions: int
    num_host_evictions: int
    adapter_load_latencies_s: tuple[tuple[str, float], ...]  # (adapter name, seconds)
    num_preemptions: int
    num_steps: int
    # adapter key -> (prompt tokens looked up in the prefix cache, tokens found), since start
    prefix_cache_tokens: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def build(cls, counts: tuple[dict[str, int], dict[str, int]], last: tuple[int, int, int], kv_usage: float,
              num_kv_blocks: int, adapters: AdapterStats, num_preemptions: int, num_steps: int,
              prefix_cache_tokens: dict[str, tuple[int, int]]) -> EngineSnapshot:
        return cls(
            num_running=counts[0], num_waiting=counts[1],
            last_batch_size=last[0], last_batch_tokens=last[1], last_batch_adapters=last[2],
            kv_cache_usage=kv_usage, num_kv_blocks=num_kv_blocks,
            adapter_pool_used_bytes=adapters.pool_used_bytes, adapter_pool_total_bytes=adapters.pool_total_bytes,
            adapter_host_bytes=adapters.host_bytes, num_adapter_loads=adapters.num_loads,
            num_adapter_load_failures=adapters.num_load_failures,
            num_device_evictions=adapters.num_device_evictions, num_host_evictions=adapters.num_host_evictions,
            adapter_load_latencies_s=adapters.load_latencies_s, num_preemptions=num_preemptions,
            num_steps=num_steps, prefix_cache_tokens=prefix_cache_tokens,
        )
