"""Per-request sampling settings (vLLM-compatible names)."""

from __future__ import annotations

import math
from functools import lru_cache
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from kubelora.engine.errors import InvalidRequest
from kubelora.engine.structured.spec import StructuredOutput

MAX_LOGPROBS = 20  # top log-probabilities per position (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on one logit_bias value
MAX_TEMPERATURE = 100.0
# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): dividing float32 logits by a smaller one overflows.
MIN_SAMPLING_TEMPERATURE = 1e-5
# repetition_penalty divides positive logits: below this floor the quotient leaves float32's range for large
# logits (and 1e-40 is a float32 subnormal, whose quotient is inf at once).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 2.0
# KMP tables kept by stop string: a request with n choices has n SamplingParams (one seed each) sharing its
# stop strings, and a table costs about 0.2 ms per 1000 characters on the engine thread. Enough for a few
# requests at the stop-string limits; at 1024 characters a table is about 10 KiB.
MAX_CACHED_STOP_TABLES = 64


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0, top_p 1, min_p 0 and the neutral penalties disable those filters.

    max_tokens None means "until max_model_len"; a max_tokens larger than the room left after the prompt is
    clipped to that room (finish_reason "length"), never rejected. A temperature below
    MIN_SAMPLING_TEMPERATURE is greedy. `return_logits` keeps each computed
    distribution (prompt positions and generated steps, float32 on the host): for tests and evaluation only.

    Logits processing (engine/sampler.py, in this order): `allowed_token_ids` keeps only those tokens;
    `bad_words_token_ids` bans the last token of each sequence whose other tokens end the output (a one-token
    sequence always); while fewer than `min_tokens` are generated, EOS and `stop_token_ids` are banned;
    `logit_bias` (token id -> added value) is added; `repetition_penalty` (> 1 discourages) divides positive
    and multiplies negative logits of tokens seen in the prompt or output; `frequency_penalty` x count and
    `presence_penalty` x seen are subtracted for output tokens. Then temperature, min_p, top_k, top_p.
    `logprobs` (None: off) returns the sampled token's log-probability and the `logprobs` most likely ones per
    generated token; `prompt_logprobs` the same for each prompt token after the first. Log-probabilities are
    of the model's distribution (log_softmax of the raw logits, before any processing), as vLLM's default.
    `structured` (engine/structured/) masks every step to the tokens its grammar allows, beside
    `allowed_token_ids`; EOS is allowed only where the grammar may end, and the request stops when it has.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # a dict {token_id: bias} is accepted and sorted
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_logits: bool = False
    structured: StructuredOutput | None = None
    # stop_token_ids as a set: the scheduler tests every sampled token against it
    stop_token_id_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._normalise()
        if self.max_tokens is not None and self.max_tokens < 1:
            _refuse("max_tokens", f"must be >= 1 or None, got {self.max_tokens}")
        self._check_floats()
        if self.top_k < 0:
            _refuse("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        self._check_counts()
        if any(not s for s in self.stop):
            _refuse("stop", "stop strings must be non-empty")

    def _check_floats(self) -> None:
        """Every float must be finite and inside its range (a NaN fails every comparison, hence the checks)."""
        _check_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if not 0.0 < self.top_p <= 1.0:
            _refuse("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        bad = next((b for _, b in self.logit_bias if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS), None)
        if bad is not None:
            _refuse("logit_bias", f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bad}")

    def _normalise(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        # Token id lists are deduplicated once here (order kept): every step reads them.
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(int(t) for t in self.stop_token_ids)))
        object.__setattr__(self, "stop_token_id_set", frozenset(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids",
                               tuple(dict.fromkeys(int(t) for t in self.allowed_token_ids)))
        object.__setattr__(self, "bad_words_token_ids",
                           tuple(tuple(int(t) for t in word) for word in self.bad_words_token_ids))

    def _check_counts(self) -> None:
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            _refuse("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                _refuse(name, f"must be in [0, {MAX_LOGPROBS}] or None, got {value}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            _refuse("allowed_token_ids", "must not be empty (None allows every token)")
        if any(not word for word in self.bad_words_token_ids):
            _refuse("bad_words_token_ids", "must not hold an empty sequence")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def has_processing(self) -> bool:
        """Some logits processor changes this request's logits (min_tokens counts: it may ban EOS)."""
        return (self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words_token_ids) or self.min_tokens > 0 or self.structured is not None)

    @cached_property
    def stop_prefix_tables(self) -> tuple[tuple[int, ...], ...]:
        """Per stop string, KMP's prefix function: entry i is the length of the longest proper prefix of
        stop[:i + 1] that is also its suffix. Computed once per parameters, and once per stop string while it
        stays in the table cache (engine/detokenizer.py scans only each step's new characters with it)."""
        return tuple(_prefix_table(stop) for stop in self.stop)

    def token_ids_used(self) -> tuple[int, ...]:
        """Every token id the settings name (checked against the vocabulary when a request is added)."""
        ids = [t for t, _ in self.logit_bias] + list(self.allowed_token_ids or ()) + list(self.stop_token_ids)
        return tuple(ids + [t for word in self.bad_words_token_ids for t in word])


@lru_cache(maxsize=MAX_CACHED_STOP_TABLES)
def _prefix_table(pattern: str) -> tuple[int, ...]:
    table = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = table[k - 1]
        k += pattern[i] == pattern[k]
        table[i] = k
    return tuple(table)


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        _refuse(name, f"must be in [{low:g}, {high:g}], got {value}")


def _refuse(name: str, reason: str) -> None:
    """InvalidRequest is a ValueError: offline callers catch ValueError, the server answers 400."""
    raise InvalidRequest(f"'{name}' {reason}", param=name, code="out_of_range")
