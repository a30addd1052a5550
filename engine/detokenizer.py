"""Output text per sequence, and stop strings.

`text` is the stable part of the output: stop strings (and what follows them) are cut, and while a sequence
runs, a trailing incomplete UTF-8 character or a suffix that may still become a stop string is held back, so
that successive `text` values only grow (the server streams their differences).
"""

from __future__ import annotations

from kubelora.engine.sequence import Sequence

REPLACEMENT_CHAR = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def update(self, seq: Sequence, is_finished: bool) -> bool:
        """Refresh seq.text after new tokens; True when a stop string matched (the caller finishes it)."""
        params = seq.params
        full = self._tokenizer.decode(seq.output_token_ids, skip_special_tokens=params.skip_special_tokens)
        stop_at = _find_stop(full, params.stop, start=max(0, len(seq.text) - _longest(params.stop)))
        if stop_at is not None:
            index, stop = stop_at
            seq.text = full[: index + len(stop)] if params.include_stop_str_in_output else full[:index]
            return True
        seq.text = full if is_finished else _stable_prefix(full, params.stop)
        return False


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    best = None
    for stop in stops:
        index = text.find(stop, start)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def _longest(stops: tuple[str, ...]) -> int:
    return max((len(s) for s in stops), default=0)


def _stable_prefix(text: str, stops: tuple[str, ...]) -> str:
    end = len(text)
    while end > 0 and text[end - 1] == REPLACEMENT_CHAR:
        end -= 1
    hold = 0  # the longest suffix that is a proper prefix of some stop string
    for stop in stops:
        for n in range(min(len(stop) - 1, end), 0, -1):
            if text[end - n : end] == stop[:n]:
                hold = max(hold, n)
                break
    return text[: end - hold]
