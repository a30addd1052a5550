"""The sampling stage's inputs: per-request settings of one step as tensors, packed on the host, one copy.

`prepare_sampling` runs once per step on the engine thread, after the forward (on CUDA: after the decode
graph's replay, which only writes logits). A step whose rows are all greedy with no logits processing and no
logprobs builds nothing (`SamplingBatch.is_plain_greedy`): the sampler takes the argmax. Otherwise only the
tensors some row needs are built, every one into a single host byte buffer (pinned on CUDA) that reaches the
device in one transfer; the sampler then slices typed views out of it. Rows with a grammar add their
matchers' token bitmask to the same buffer (filled here, on the host: xgrammar's masks are CPU work).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubelora.engine.sequence import Sequence
from kubelora.engine.structured.matcher import fill_bitmask

_ALIGN = 8  # bytes: every region starts on an int64 boundary so a typed view of the byte buffer is legal


@dataclass(frozen=True)
class Penalties:
    """presence/frequency over output tokens, repetition over prompt + output tokens (vLLM's split)."""

    output_tokens: torch.Tensor  # [num_rows, max_output] int64, padded with vocab_size (a column dropped later)
    seen_tokens: torch.Tensor  # [num_rows, max_seen] int64: prompt + output of rows with repetition, padded
    presence: torch.Tensor  # [num_rows] float32
    frequency: torch.Tensor  # [num_rows] float32
    repetition: torch.Tensor  # [num_rows] float32, 1 where off


@dataclass(frozen=True)
class SparseTokens:
    """(row, token) pairs, with a value each where one is needed (logit_bias)."""

    rows: torch.Tensor  # [num_pairs] int64
    tokens: torch.Tensor  # [num_pairs] int64
    values: torch.Tensor | None = None  # [num_pairs] float32


@dataclass(frozen=True)
class SamplingBatch:
    """One step's sampling inputs; rows follow the logits rows handed to `sample`."""

    num_rows: int
    is_plain_greedy: bool  # argmax of the raw logits is the whole answer
    greedy_rows: tuple[bool, ...]
    generators: tuple[torch.Generator | None, ...]
    num_logprobs: tuple[int | None, ...]  # per row: top log-probabilities asked for (None: none)
    temperature: torch.Tensor | None = None  # [num_rows] float32, 1 for greedy rows
    top_k: torch.Tensor | None = None  # [num_rows] int64, vocab_size where off
    top_p: torch.Tensor | None = None  # [num_rows] float32
    min_p: torch.Tensor | None = None  # [num_rows] float32
    penalties: Penalties | None = None
    logit_bias: SparseTokens | None = None
    banned: SparseTokens | None = None  # bad words and, before min_tokens, EOS and stop ids
    allowed_rows: torch.Tensor | None = None  # [num_allowed_rows] int64: the rows with allowed_token_ids
    # [num_allowed_rows, ceil(vocab / 32)] int32: bit t % 32 of word t // 32 set where token t is allowed
    allowed_bitmask: torch.Tensor | None = None
    grammar_rows: torch.Tensor | None = None  # [num_grammar_rows] int64: the rows with a grammar
    # [num_grammar_rows, ceil(vocab / 32)] int32: bit t % 32 of word t // 32 set where token t is allowed
    grammar_bitmask: torch.Tensor | None = None
    # some grammar row also has an allowed list or banned tokens: together they may leave it no token
    has_grammar_conflict: bool = False

    @property
    def has_processing(self) -> bool:
        return any(x is not None for x in (self.penalties, self.logit_bias, self.banned, self.allowed_rows,
                                           self.grammar_bitmask))

    @property
    def is_greedy_grammar_only(self) -> bool:
        """Every row greedy, no log-probabilities, and grammar masks the only processing: the sampler then masks
        only the grammar rows' logits instead of a copy of them all."""
        return (self.grammar_bitmask is not None and all(self.greedy_rows) and self.max_logprobs is None
                and all(x is None for x in (self.penalties, self.logit_bias, self.banned, self.allowed_rows)))

    @property
    def max_logprobs(self) -> int | None:
        asked = [k for k in self.num_logprobs if k is not None]
        return max(asked) if asked else None


def prepare_sampling(seqs: list[Sequence], vocab_size: int, device: torch.device,
                     eos_token_ids: tuple[int, ...] = ()) -> SamplingBatch:
    params = [s.params for s in seqs]
    greedy = tuple(p.is_greedy for p in params)
    base = dict(num_rows=len(seqs), greedy_rows=greedy, generators=tuple(s.generator for s in seqs),
                num_logprobs=tuple(p.logprobs for p in params))
    if all(greedy) and not any(p.has_processing or p.logprobs is not None for p in params):
        return SamplingBatch(is_plain_greedy=True, **base)
    pack = _HostPack()
    if not all(greedy):
        _add_filters(pack, params, vocab_size)
    if any(p.has_penalties for p in params):
        _add_penalties(pack, seqs, vocab_size)
    _add_sparse(pack, seqs, vocab_size, eos_token_ids)
    has_conflict = _add_grammar(pack, seqs, vocab_size, eos_token_ids)
    views = pack.to(device)
    return SamplingBatch(is_plain_greedy=False, **base, **_assemble(views), has_grammar_conflict=has_conflict)


def _add_filters(pack: _HostPack, params, vocab_size: int) -> None:
    pack.add("temperature", [1.0 if p.is_greedy else p.temperature for p in params], torch.float32)
    if any(p.top_k > 0 for p in params):
        pack.add("top_k", [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], torch.int64)
    if any(p.top_p < 1.0 for p in params):
        pack.add("top_p", [p.top_p for p in params], torch.float32)
    if any(p.min_p > 0.0 for p in params):
        pack.add("min_p", [p.min_p for p in params], torch.float32)


def _add_penalties(pack: _HostPack, seqs: list[Sequence], vocab_size: int) -> None:
    """Token histories as padded rows; rows without a penalty send only padding."""
    outputs = [s.output_token_ids if s.params.has_penalties else [] for s in seqs]
    seen = [s.prompt_token_ids + s.output_token_ids if s.params.repetition_penalty != 1.0 else [] for s in seqs]
    pack.add("output_tokens", _padded(outputs, vocab_size), torch.int64)
    pack.add("seen_tokens", _padded(seen, vocab_size), torch.int64)
    pack.add("presence", [s.params.presence_penalty for s in seqs], torch.float32)
    pack.add("frequency", [s.params.frequency_penalty for s in seqs], torch.float32)
    pack.add("repetition", [s.params.repetition_penalty for s in seqs], torch.float32)


def _add_sparse(pack: _HostPack, seqs: list[Sequence], vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
    bias, banned = ([], [], []), ([], [])
    for row, seq in enumerate(seqs):
        for token, value in seq.params.logit_bias:
            bias[0].append(row), bias[1].append(token), bias[2].append(value)
        tokens = _banned_tokens(seq, eos_token_ids)
        banned[0].extend([row] * len(tokens)), banned[1].extend(tokens)
    for name, lists in (("bias", bias), ("banned", banned)):
        if lists[0]:
            pack.add(f"{name}_rows", lists[0], torch.int64)
            pack.add(f"{name}_tokens", lists[1], torch.int64)
    if bias[0]:
        pack.add("bias_values", bias[2], torch.float32)
    allowed = [row for row, seq in enumerate(seqs) if seq.params.allowed_token_ids is not None]
    if allowed:
        pack.add("allowed_rows", allowed, torch.int64)
        pack.add_tensor("allowed_bitmask", torch.stack([allowed_bitmask(seqs[row], vocab_size) for row in allowed]))


def allowed_bitmask(seq: Sequence, vocab_size: int) -> torch.Tensor:
    """The request's allowed_token_ids as a [ceil(vocab / 32)] int32 host bitmask: the one `LLMEngine.add_request`
    built at admission (a step copies 4 bytes per 32 tokens instead of walking the list), else built here."""
    if seq.allowed_bitmask is not None:
        return seq.allowed_bitmask
    return token_bitmask(seq.params.allowed_token_ids, vocab_size)


def token_bitmask(token_ids: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    """[ceil(vocab / 32)] int32: bit t % 32 of word t // 32 set for each t in token_ids (xgrammar's layout)."""
    num_words = -(-vocab_size // 32)
    is_set = torch.zeros(num_words * 32, dtype=torch.bool)
    is_set[torch.tensor(token_ids, dtype=torch.int64)] = True
    words = (is_set.view(num_words, 32).long() << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 is int32's sign bit


def _add_grammar(pack: _HostPack, seqs: list[Sequence], vocab_size: int, eos_token_ids: tuple[int, ...]) -> bool:
    """The grammar rows' masks; returns whether another filter of some grammar row could empty it."""
    # A row of a request that stopped while this step was queued (its grammar may have ended) is dropped later.
    rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None and not seq.status.is_finished]
    if not rows:
        return False
    pack.add("grammar_rows", rows, torch.int64)
    pack.add_tensor("grammar_bitmask", fill_bitmask([seqs[row].grammar for row in rows], vocab_size))
    return any(seqs[row].params.allowed_token_ids is not None or _banned_tokens(seqs[row], eos_token_ids)
               for row in rows)


def _banned_tokens(seq: Sequence, eos_token_ids: tuple[int, ...]) -> list[int]:
    """Bad words whose prefix ends the output, and the stop tokens while min_tokens is not reached."""
    p, output = seq.params, seq.output_token_ids
    banned = [w[-1] for w in p.bad_words_token_ids
              if len(w) == 1 or (len(output) >= len(w) - 1 and tuple(output[len(output) - len(w) + 1:]) == w[:-1])]
    if seq.num_tokens_before_sampled < p.min_tokens:
        banned += list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
    return banned


def _padded(rows: list[list[int]], pad: int) -> list[list[int]]:
    width = max(1, max(len(r) for r in rows))
    return [r + [pad] * (width - len(r)) for r in rows]


def _assemble(views: dict[str, torch.Tensor]) -> dict:
    fields = {k: views.get(k) for k in ("temperature", "top_k", "top_p", "min_p", "allowed_rows", "allowed_bitmask",
                                        "grammar_rows", "grammar_bitmask")}
    if "output_tokens" in views:
        fields["penalties"] = Penalties(views["output_tokens"], views["seen_tokens"], views["presence"],
                                        views["frequency"], views["repetition"])
    if "bias_rows" in views:
        fields["logit_bias"] = SparseTokens(views["bias_rows"], views["bias_tokens"], views["bias_values"])
    if "banned_rows" in views:
        fields["banned"] = SparseTokens(views["banned_rows"], views["banned_tokens"])
    return fields


class _HostPack:
    """Typed host tensors laid out in one byte buffer; `to` copies it once and returns typed device views."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._regions: dict[str, tuple[int, torch.dtype, torch.Size]] = {}
        self._num_bytes = 0

    def add(self, name: str, values: list, dtype: torch.dtype) -> None:
        self.add_tensor(name, torch.tensor(values, dtype=dtype))

    def add_tensor(self, name: str, host: torch.Tensor) -> None:
        dtype = host.dtype
        raw = host.reshape(-1).view(torch.uint8)
        self._regions[name] = (self._num_bytes, dtype, host.shape)
        pad = -raw.numel() % _ALIGN
        self._parts += [raw, torch.zeros(pad, dtype=torch.uint8)] if pad else [raw]
        self._num_bytes += raw.numel() + pad

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        if not self._parts:
            return {}
        host = torch.cat(self._parts)
        if device.type == "cuda":
            host = host.pin_memory()
        buf = host.to(device, non_blocking=True)
        views = {}
        for name, (offset, dtype, shape) in self._regions.items():
            size = shape.numel() * torch.empty((), dtype=dtype).element_size()
            views[name] = buf[offset : offset + size].view(dtype).reshape(shape)
        return views
