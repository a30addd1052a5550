"""Per-sequence grammar state: the token bitmask of the next step and the advance on each sampled token."""

from __future__ import annotations

import enum
import threading

import torch

BITS = 32  # tokens per int32 word of a bitmask row: bit t % 32 of word t // 32 set = token t allowed


class Advance(enum.Enum):
    ACCEPTED = "accepted"  # more tokens may follow
    COMPLETED = "completed"  # the grammar has ended (the stop token was taken): the request finishes
    REJECTED = "rejected"  # the token was not allowed (a mask and another filter left nothing valid)


def new_matcher(grammar):
    import xgrammar

    return xgrammar.GrammarMatcher(grammar)


_local = threading.local()


def fill_bitmask(matchers: list, vocab_size: int) -> torch.Tensor:
    """[len(matchers), ceil(vocab / 32)] int32 on the host: each row the tokens its matcher allows next."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab_size)
    if len(matchers) == 1:
        matchers[0].fill_next_token_bitmask(bitmask, 0)
    elif matchers:  # xgrammar fills the rows on its own threads (half the cores, one per row at most)
        _batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask)
    return bitmask


def _batch_matcher():
    """The calling thread's xgrammar.BatchGrammarMatcher (one per thread: a call is not shared across threads)."""
    matcher = getattr(_local, "batch", None)
    if matcher is None:
        import xgrammar

        matcher = _local.batch = xgrammar.BatchGrammarMatcher(max_threads="auto")
    return matcher


def advance(matcher, token: int) -> Advance:
    if not matcher.accept_token(token):
        return Advance.REJECTED
    return Advance.COMPLETED if matcher.is_terminated() else Advance.ACCEPTED


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [rows, words] int32 -> [rows, vocab_size] bool (True: allowed), on the bitmask's device."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
