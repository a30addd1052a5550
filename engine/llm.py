"""Offline API: `LLM(model_dir, ...)`, `load_adapter`, `generate` (used by tests, the demo and benchmarks)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceOf
from pathlib import Path

from kubelora.engine.adapters.types import AdapterInfo
from kubelora.engine.config import EngineConfig
from kubelora.engine.engine import LLMEngine
from kubelora.engine.outputs import GenerationResult, RequestOutput
from kubelora.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Synchronous wrapper around one LLMEngine. Keyword options are EngineConfig fields."""

    def __init__(self, model_dir: str | Path, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model_dir=str(model_dir), **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def load_adapter(self, name: str, path: str | Path, *, load_inplace: bool = False,
                     preload: bool = True) -> AdapterInfo:
        return self.engine.adapters.load(name, path, load_inplace=load_inplace, preload=preload)

    def unload_adapter(self, name: str) -> bool:
        return self.engine.adapters.unload(name)

    def capture_graphs(self) -> None:
        """Capture the decode graphs the loaded adapters' shapes need (on CUDA; `generate` does it first, so
        no capture stalls a batch midway)."""
        self.engine.capture_pending_graphs(budget_s=float("inf"))  # all of them, unless requests are in flight

    def list_adapters(self) -> list[AdapterInfo]:
        return self.engine.adapters.list()

    def generate(self, prompts: Prompt | SequenceOf[Prompt],
                 sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
                 adapters: str | SequenceOf[str | None] | None = None,
                 cache_salts: str | SequenceOf[str | None] | None = None) -> list[GenerationResult]:
        """One result per prompt, in order. A string prompt is tokenized; a list of ints is used as is.
        `cache_salts`: each request's cache_salt (LLMEngine.add_request)."""
        prompts = [prompts] if isinstance(prompts, str) or _is_token_list(prompts) else list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        names = _per_prompt(adapters, len(prompts), "adapters")
        salts = _per_prompt(cache_salts, len(prompts), "cache_salts")
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        request_ids = [f"gen-{next(self._ids)}" for _ in prompts]
        finals = self._run(list(zip(request_ids, token_lists, params, names, salts)))
        return [_result(finals[rid], tokens) for rid, tokens in zip(request_ids, token_lists)]

    def _run(self, requests: list[tuple]) -> dict[str, RequestOutput]:
        """Feed requests as the waiting queue has room; step until every one has finished."""
        self.capture_graphs()
        pending = list(reversed(requests))
        finals: dict[str, RequestOutput] = {}
        while pending or len(finals) < len(requests):
            while pending and self.engine.has_waiting_room():
                request_id, tokens, params, name, salt = pending.pop()
                self.engine.add_request(request_id, tokens, params, name, cache_salt=salt)
            for output in self.engine.step():
                if output.finished:
                    finals[output.request_id] = output
        return finals

    def close(self) -> None:
        self.engine.close()


def _is_token_list(prompts) -> bool:
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)


def _per_prompt(value, count: int, name: str) -> list:
    if value is None or isinstance(value, (str, SamplingParams)):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"{name} must have one entry per prompt ({count}), got {len(values)}")
    return values


def _result(output: RequestOutput, prompt_token_ids: list[int]) -> GenerationResult:
    return GenerationResult(
        request_id=output.request_id,
        prompt_token_ids=prompt_token_ids,
        adapter=output.adapter,
        token_ids=output.token_ids,
        text=output.text,
        finish_reason=output.finish_reason,
        error=output.error,
        prompt_logits=output.prompt_logits,
        logits=output.logits,
        logprobs=output.logprobs,
        prompt_logprobs=output.prompt_logprobs,
        num_cached_tokens=output.num_cached_tokens,
    )
