"""The sampling stage: logits processing, greedy / temperature / min-p / top-k / top-p draws, logprobs.

Inputs: logits [num_rows, vocab] float32 (on CUDA a view of the decode graph's static output: never written
here) and one `SamplingBatch` (engine/sampling_batch.py). Every filter is a batched tensor op; the draw is
per row only for seeded requests, so a seeded request gives the same tokens whatever else shares its batch.
Output: the sampled ids and, for rows that ask, their log-probabilities, in one device -> host copy. A row
with no valid distribution is reported in that same copy as a negative id (FAULT_*): its logits hold a NaN or
+inf (the model or its adapter), or its filters or penalties left no finite logit. Its device id stays a valid
token (the next step may read it; the engine fails the request when it reads the fault back).
`sample_on_device` starts that copy without waiting for it (`SampledStep.result` waits), and keeps the ids on
the device too, where the next step can read them before the host has (engine/engine.py overlaps steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubelora.engine.sampling_batch import Penalties, SamplingBatch
from kubelora.engine.structured.matcher import unpack_bitmask

LOGPROB_FLOOR = -9999.0  # what a -inf log-probability is reported as (JSON has no infinity), as vLLM does
FAULT_NON_FINITE_LOGITS = -1  # host id of a row whose raw logits hold a NaN or +inf, or are all -inf
FAULT_NO_TOKEN_LEFT = -2  # host id of a row whose processed logits have no finite maximum


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the chosen token's log-probability and the top ones (most likely first)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the row did not ask


class SampledStep:
    """The sampling stage of one step, launched: ids on the device, their copy to the host in flight."""

    def __init__(self, tokens: torch.Tensor, reported: torch.Tensor, packed_logprobs: torch.Tensor | None,
                 batch: SamplingBatch) -> None:
        """tokens: [num_rows] int64 valid ids; reported: the same with FAULT_* where a row failed (copied back
        unless packed_logprobs, whose first column holds it)."""
        self.tokens = tokens  # [num_rows] int64 on the logits' device
        self._num_logprobs = batch.num_logprobs
        self._k = batch.max_logprobs if packed_logprobs is not None else None
        packed = reported if packed_logprobs is None else packed_logprobs
        self._event = None
        if packed.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = packed

    def result(self) -> SamplerOutput:
        """Waits for the copy (only for it: later work on the device goes on)."""
        if self._event is not None:
            self._event.synchronize()
        if self._k is None:
            return SamplerOutput(self._host.tolist(), [None] * len(self._num_logprobs))
        rows = _unpack_logprobs(self._host.tolist(), self._k)
        return SamplerOutput([r.token_id for r in rows],
                             [keep_top(r, k) if k is not None else None for r, k in zip(rows, self._num_logprobs)])


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits: [num_rows, vocab] float32 -> one token id per row (and logprobs where asked)."""
    return sample_on_device(logits, batch).result()


def sample_on_device(logits: torch.Tensor, batch: SamplingBatch) -> SampledStep:
    """The sampling stage without a host sync: the ids stay on the device, their host copy is started. Each row's
    fault check is a max taken with its argmax (or over the scaled logits a draw computes anyway)."""
    if batch.is_plain_greedy:
        best, tokens = logits.max(dim=-1)
        return SampledStep(tokens, _reported(tokens, best), None, batch)
    if batch.is_greedy_grammar_only:  # the argmax of every row, then of the grammar rows' masked logits
        best, tokens = logits.max(dim=-1)
        tokens[batch.grammar_rows] = _grammar_masked(logits, batch)[0].argmax(dim=-1)
        return SampledStep(tokens, _reported(tokens, best), None, batch)
    raw_best = logits.amax(dim=-1)
    processed = process_logits(logits, batch)
    best, tokens = processed.max(dim=-1)
    if not all(batch.greedy_rows):
        tokens, best = _draw(processed, batch, tokens)
    reported = _reported(tokens, raw_best, best)
    if batch.max_logprobs is None:
        return SampledStep(tokens, reported, None, batch)
    packed = _pack_logprobs(torch.log_softmax(logits.float(), dim=-1), tokens, batch.max_logprobs, reported)
    return SampledStep(tokens, reported, packed, batch)


def _reported(tokens: torch.Tensor, raw_best: torch.Tensor, best: torch.Tensor | None = None) -> torch.Tensor:
    """tokens with FAULT_* where a row's maximum (raw, then processed) is not finite: a NaN anywhere in a row
    makes its max NaN, so one [num_rows] check covers the whole row."""
    reported = tokens if best is None else tokens.masked_fill(~torch.isfinite(best), FAULT_NO_TOKEN_LEFT)
    return reported.masked_fill(~torch.isfinite(raw_best), FAULT_NON_FINITE_LOGITS)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits after allowed/banned tokens, grammar masks, logit bias and penalties (a new tensor; `logits`
    is kept)."""
    if not batch.has_processing:
        return logits
    out = logits.clone()
    if batch.allowed_rows is not None:
        is_allowed = unpack_bitmask(batch.allowed_bitmask, out.shape[1])
        out[batch.allowed_rows] = out[batch.allowed_rows].masked_fill_(~is_allowed, float("-inf"))
    if batch.banned is not None:
        out[batch.banned.rows, batch.banned.tokens] = float("-inf")
    if batch.grammar_bitmask is not None:
        out = apply_grammar(out, logits, batch)
    if batch.logit_bias is not None:
        out.index_put_((batch.logit_bias.rows, batch.logit_bias.tokens), batch.logit_bias.values, accumulate=True)
    if batch.penalties is not None:
        out = apply_penalties(out, batch.penalties)
    return out


def apply_grammar(out: torch.Tensor, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Keep only the tokens each grammar row's matcher allows. Where the other filters (allowed_token_ids,
    bad words, min_tokens' EOS ban) left none of those, the grammar alone decides: a row with no token left
    would make the draw fail, and any token outside the grammar breaks the output."""
    rows = batch.grammar_rows
    masked, allowed = _grammar_masked(out, batch)
    if batch.has_grammar_conflict:  # known on the host: the common step pays no check
        is_dead = masked.amax(dim=1, keepdim=True) == float("-inf")
        masked = torch.where(is_dead, logits[rows].masked_fill(~allowed, float("-inf")), masked)
    out[rows] = masked
    return out


def _grammar_masked(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(the grammar rows of logits with every token their matcher forbids at -inf, the allowed mask
    [num_grammar_rows, vocab] bool); logits is left as it is (indexing the rows copies them)."""
    allowed = unpack_bitmask(batch.grammar_bitmask, logits.shape[1])
    return logits[batch.grammar_rows].masked_fill_(~allowed, float("-inf")), allowed


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition as transformers' RepetitionPenaltyLogitsProcessor (positive / r, negative * r) over the
    prompt and output; then logits - frequency * count - presence * (count > 0) over the output (OpenAI)."""
    num_rows, vocab = logits.shape
    seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, penalties.seen_tokens, True)
    seen = seen[:, :vocab]
    rep = penalties.repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, penalties.output_tokens, torch.ones_like(penalties.output_tokens, dtype=logits.dtype))
    counts = counts[:, :vocab]
    return logits - penalties.frequency[:, None] * counts - penalties.presence[:, None] * (counts > 0)


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Probabilities after temperature, min_p, top_k and top_p (vLLM's order)."""
    return _filtered_probs(_scaled(logits, batch)[0], batch)


def _scaled(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits / temperature with every row whose maximum is not finite set to 0, each row's maximum): a NaN or
    inf must not reach the draw (multinomial rejects it on the host and is undefined on CUDA); that row's
    token is reported as a fault and never used."""
    scaled = logits / batch.temperature[:, None]
    best = scaled.amax(dim=-1)
    return scaled.masked_fill_(~torch.isfinite(best)[:, None], 0.0), best


def _filtered_probs(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.min_p is not None:
        scaled = apply_min_p(scaled, batch.min_p)
    if batch.top_k is not None:
        scaled = apply_top_k(scaled, batch.top_k)
    if batch.top_p is not None:
        scaled = apply_top_p(scaled, batch.top_p)
    return torch.softmax(scaled, dim=-1)


def _draw(logits: torch.Tensor, batch: SamplingBatch, greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(one id per row: drawn for sampled rows, `greedy` for the others; each row's scaled maximum)."""
    scaled, best = _scaled(logits, batch)
    probs = _filtered_probs(scaled, batch)
    tokens = greedy.clone()
    sampled_rows = [i for i, g in enumerate(batch.greedy_rows) if not g]
    unseeded = [i for i in sampled_rows if batch.generators[i] is None]
    if unseeded:
        tokens[unseeded] = torch.multinomial(probs[unseeded], 1).squeeze(1)
    for i in sampled_rows:  # a seeded request draws from its own generator
        if batch.generators[i] is not None:
            tokens[i] = torch.multinomial(probs[i], 1, generator=batch.generators[i])[0]
    return tokens, best


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top one's (transformers' MinPLogitsWarper)."""
    probs = torch.softmax(logits, dim=-1)
    floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """top_k: [num_rows] int64 in [1, vocab] (vocab keeps every token)."""
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (top_k - 1)[:, None])  # [num_rows, 1] the k-th largest value
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest prefix of tokens (by probability) whose mass reaches top_p; always the top one."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p[:, None]
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """logprobs: [num_rows, vocab]; tokens: [num_rows] -> per row, with ids and values in one host copy."""
    return _unpack_logprobs(_pack_logprobs(logprobs, tokens, k, tokens).tolist(), k)


def _pack_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, k: int, reported: torch.Tensor) -> torch.Tensor:
    """[num_rows, 2 + 2k] float64 on the device: the reported id, the token's logprob, the top k ids, their
    logprobs."""
    chosen = logprobs.gather(1, tokens[:, None])
    parts = [reported[:, None].double(), chosen.double()]
    if k:
        top = logprobs.topk(k, dim=-1)
        parts += [top.indices.double(), top.values.double()]
    return torch.cat(parts, dim=1).clamp(min=LOGPROB_FLOOR)  # ids are > LOGPROB_FLOOR: the clamp keeps them


def _unpack_logprobs(host: list[list[float]], k: int) -> list[TokenLogprobs]:
    return [TokenLogprobs(int(r[0]), r[1], tuple(int(t) for t in r[2 : 2 + k]), tuple(r[2 + k :])) for r in host]


def keep_top(row: TokenLogprobs, k: int) -> TokenLogprobs:
    return TokenLogprobs(row.token_id, row.logprob, row.top_ids[:k], row.top_logprobs[:k])


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """logits: [num_rows, vocab] at prompt positions; targets: [num_rows] the next prompt token of each."""
    return _logprobs(torch.log_softmax(logits.float(), dim=-1), targets, k)

