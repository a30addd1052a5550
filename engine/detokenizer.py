"""Output text per sequence, and stop strings.

`text` is the stable part of the output: stop strings (and what follows them) are cut, and while a sequence
runs, a trailing incomplete UTF-8 character or a suffix that may still become a stop string is held back, so
that successive `text` values only grow (the server streams their differences). Stop strings cost each step
only the characters decoded since the last one: the search starts the longest stop string's length before the
end of the stable text, and the held-back suffix comes from KMP states kept on the sequence.
"""

from __future__ import annotations

from kubelora.engine.sequence import Sequence

REPLACEMENT_CHAR = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        # The Rust tokenizer's own decode gives transformers' text when no space clean-up applies, at a fifth
        # of the host time (it runs twice per sequence and step on the engine thread).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        is_raw = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._decode = backend.decode if is_raw else tokenizer.decode

    def update(self, seq: Sequence, is_finished: bool) -> bool:
        """Refresh seq.text after new tokens; True when a stop string matched (the caller finishes it)."""
        params = seq.params
        tail = self._decode_tail(seq, params.skip_special_tokens)  # first: it may move text into decoded_text
        full = seq.decoded_text + tail
        stop_at = _find_stop(full, params.stop, start=max(0, len(seq.text) - _longest(params.stop)))
        if stop_at is not None:
            index, stop = stop_at
            seq.text = full[: index + len(stop)] if params.include_stop_str_in_output else full[:index]
            return True
        seq.text = full if is_finished else full[: _stable_end(seq, full)]
        return False

    def _decode_tail(self, seq: Sequence, skip_special_tokens: bool) -> str:
        """The text of the tokens after read_offset, decoding only a short window each step (decoding the
        whole output every step is quadratic in its length, on the engine thread).

        The window starts at prefix_offset so that tokenizers whose decoding depends on the previous token
        (a leading space dropped at the start of a decode) give the same characters; the offsets only move
        once the new text is complete (no trailing U+FFFD of a split UTF-8 character).
        """
        ids = seq.output_token_ids
        context = self._decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip_special_tokens)
        window = self._decode(ids[seq.prefix_offset :], skip_special_tokens=skip_special_tokens)
        if not window.startswith(context):  # the new tokens changed earlier characters: decode it all again
            seq.decoded_text, seq.prefix_offset, seq.read_offset = "", 0, 0
            seq.stop_states = []  # the stop scan starts again too
            context, window = "", self._decode(ids, skip_special_tokens=skip_special_tokens)
        tail = window[len(context) :]
        if tail and not tail.endswith(REPLACEMENT_CHAR):
            seq.decoded_text += tail
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
            return ""
        return tail


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    best = None
    for stop in stops:
        index = text.find(stop, start)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def _longest(stops: tuple[str, ...]) -> int:
    return max((len(s) for s in stops), default=0)


def _stable_end(seq: Sequence, full: str) -> int:
    """The end of the text a running sequence may show: trailing U+FFFD (a split character) and the longest
    suffix that is a proper prefix of a stop string are held back."""
    end = len(full)
    while end > 0 and full[end - 1] == REPLACEMENT_CHAR:
        end -= 1
    stops, committed = seq.params.stop, len(seq.decoded_text)
    if not stops:
        return end
    if end < committed:  # a committed character is a U+FFFD: no scan state covers it
        return len(_stable_prefix(full[:end], stops))
    _scan_committed(seq, stops)
    new = full[committed:end]
    hold = max(_advance(state, new, stop, table)
               for state, stop, table in zip(seq.stop_states, stops, seq.params.stop_prefix_tables))
    return end - min(hold, end)


def _scan_committed(seq: Sequence, stops: tuple[str, ...]) -> None:
    """Bring the KMP states up to all of decoded_text (it only grows, except when `_decode_tail` decodes
    everything again and empties the states). A state depends only on the last len(stop) - 1 characters, so a
    restart scans those."""
    text, tables = seq.decoded_text, seq.params.stop_prefix_tables
    if seq.stop_states:
        new = text[seq.num_stop_scanned :]
        seq.stop_states = [_advance(state, new, stop, table)
                           for state, stop, table in zip(seq.stop_states, stops, tables)]
    else:
        seq.stop_states = [_advance(0, text[max(0, len(text) - len(stop) + 1) :], stop, table)
                           for stop, table in zip(stops, tables)]
    seq.num_stop_scanned = len(text)


def _advance(state: int, text: str, stop: str, table: tuple[int, ...]) -> int:
    """KMP: from the length of the longest suffix that is a proper prefix of stop, through text. A complete
    match falls back to its longest border (the caller has found any match with str.find already)."""
    for char in text:
        while state and (state == len(stop) or stop[state] != char):
            state = table[state - 1]
        if stop[state] == char:
            state += 1
    return table[state - 1] if state == len(stop) else state


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
