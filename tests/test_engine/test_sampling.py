"""Sampling: greedy/temperature/top-k/top-p, per-request seeds, stop strings and stop token ids, max_tokens."""

from __future__ import annotations

import pytest
import torch

from kubelora.engine import SamplingParams
from kubelora.engine.detokenizer import _stable_prefix
from kubelora.engine.sampler import sample


def _draws(sampling_batch, logits: torch.Tensor, params: SamplingParams, num: int = 400) -> set[int]:
    generators = [torch.Generator().manual_seed(i) for i in range(num)]
    rows = logits.expand(num, -1)
    return set(sample(rows, sampling_batch(rows, [params] * num, generators)).token_ids)


def test_top_k_restricts_support_to_the_k_largest(sampling_batch):
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0, 2.9]])
    assert _draws(sampling_batch, logits, SamplingParams(temperature=5.0, top_k=3)) == {1, 3, 5}
    assert _draws(sampling_batch, logits, SamplingParams(temperature=5.0, top_k=1)) == {1}


def test_top_p_keeps_the_smallest_prefix_reaching_p(sampling_batch):
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    assert _draws(sampling_batch, logits, SamplingParams(temperature=1.0, top_p=0.7)) == {1, 3}
    assert _draws(sampling_batch, logits, SamplingParams(temperature=1.0, top_p=0.85)) == {1, 2, 3}
    assert _draws(sampling_batch, logits, SamplingParams(temperature=1.0, top_p=0.01)) == {1}


def test_greedy_rows_ignore_sampling_rows(sampling_batch):
    logits = torch.tensor([[0.0, 1.0, 0.5], [3.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)]
    assert sample(logits, sampling_batch(logits, params, [None, torch.Generator().manual_seed(3)])).token_ids[0] == 1


def test_sampling_params_validation():
    for bad in ({"top_p": 0.0}, {"top_k": -1}, {"temperature": -1.0}, {"max_tokens": 0}, {"stop": ("",)},
                {"min_p": 1.5}, {"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"repetition_penalty": 0.0},
                {"logit_bias": {3: 101.0}}, {"min_tokens": 20, "max_tokens": 10}, {"logprobs": 21},
                {"prompt_logprobs": -1}, {"allowed_token_ids": ()}, {"bad_words_token_ids": ((),)},
                {"temperature": float("nan")}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(stop="###").stop == ("###",)


def test_seeded_requests_reproduce_whatever_shares_the_batch(llama_llm, prompt_ids):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = prompt_ids(2, 8)
    alone = llama_llm.generate([prompt], seeded, adapters=["r8-all"])[0]
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    crowd = llama_llm.generate([prompt_ids(i, 5 + i) for i in range(5)] + [prompt],
                               [others] * 5 + [seeded], adapters=[None, "r4-qv", "r8-all", None, "r32-attn", "r8-all"])
    assert crowd[-1].token_ids == alone.token_ids
    other_seed = llama_llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=99,
                                                              ignore_eos=True), adapters=["r8-all"])[0]
    assert other_seed.token_ids != alone.token_ids


def test_stop_token_ids_and_max_tokens(llama_llm, prompt_ids):
    prompt = prompt_ids(4, 6)
    free = llama_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    stopped = llama_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                          stop_token_ids=(stop_id,)))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: first + 1]


def test_stop_strings_cut_the_text(llama_llm, prompt_ids):
    prompt = prompt_ids(5, 6)
    free = llama_llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                              adapters=["r4-qv"])[0]
    text = free.text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip() and "\ufffd" not in
                text[i : i + 2])
    cut = text.index(stop)
    stopped = llama_llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                          stop=(stop, "never-there")), adapters=["r4-qv"])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:cut]
    assert len(stopped.token_ids) < len(free.token_ids)
    kept = llama_llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=stop,
                                                       include_stop_str_in_output=True), adapters=["r4-qv"])[0]
    assert kept.text == text[: cut + len(stop)]


def test_stream_text_holds_back_partial_stop_strings_and_characters():
    assert _stable_prefix("hello wor", ("world",)) == "hello "
    assert _stable_prefix("hello w", ("xyz",)) == "hello w"
    assert _stable_prefix("abc\ufffd", ()) == "abc"
    assert _stable_prefix("a##", ("###", "#!")) == "a"


def test_stop_scan_holds_back_what_a_full_rescan_holds_back():
    """The held-back suffix from KMP states advanced by each step's new characters equals a rescan of the whole
    text, across growing text, uncommitted tails with split characters and re-decodes that empty the states."""
    import random

    from kubelora.engine.detokenizer import _stable_end
    from kubelora.engine.sequence import Sequence

    rng = random.Random(0)
    for _ in range(400):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3)))
        seq = Sequence("s", [1], SamplingParams(stop=stops), None, None, 64, 0.0)
        for _ in range(12):
            seq.decoded_text += "".join(rng.choice("abc") for _ in range(rng.randint(0, 3)))
            if rng.random() < 0.1:  # the detokenizer decoded everything again
                seq.decoded_text, seq.stop_states = "".join(rng.choice("abc") for _ in seq.decoded_text), []
            full = seq.decoded_text + rng.choice(["", "a\ufffd", "\ufffd", "ab\ufffd\ufffd"])
            assert full[: _stable_end(seq, full)] == _stable_prefix(full, stops), (stops, full)
        assert seq.num_stop_scanned == len(seq.decoded_text)


def test_long_stop_strings_cost_only_the_new_characters(monkeypatch):
    """16 stop strings of 2,000 characters: a step scans the few characters it decoded, not every prefix of
    every stop string (the prefix tables are built once per parameters)."""
    import kubelora.engine.detokenizer as detokenizer
    from kubelora.engine.sequence import Sequence

    params = SamplingParams(stop=tuple("x" * 1999 + str(i % 10) + chr(65 + i) for i in range(16)))
    assert len(params.stop_prefix_tables) == 16 and params.stop_prefix_tables is params.stop_prefix_tables
    seq = Sequence("s", [1], params, None, None, 64, 0.0)
    scanned: list[int] = []
    advance = detokenizer._advance

    def counting(state, text, stop, table):
        scanned.append(len(text))
        return advance(state, text, stop, table)

    monkeypatch.setattr(detokenizer, "_advance", counting)
    for _ in range(50):
        seq.decoded_text += "xxxx"
        assert detokenizer._stable_end(seq, seq.decoded_text) == 0  # all x: a prefix of every stop string
    assert max(scanned) <= 4 and sum(scanned) <= 50 * 16 * 4


def test_incremental_detokenization_equals_decoding_everything(llama):
    """The engine decodes a short window per step; the text must equal one decode of all output tokens,
    at every step, for random ids (split multi-byte characters and special tokens included)."""
    from transformers import AutoTokenizer

    from kubelora.engine.detokenizer import Detokenizer, _stable_prefix
    from kubelora.engine.sequence import Sequence

    tokenizer = AutoTokenizer.from_pretrained(llama.model_dir)
    detokenizer = Detokenizer(tokenizer)
    generator = torch.Generator().manual_seed(7)
    for skip_special in (True, False):
        params = SamplingParams(max_tokens=200, skip_special_tokens=skip_special)
        seq = Sequence(request_id="r", prompt_token_ids=[1], params=params, adapter_name=None, adapter=None,
                       max_tokens=200, arrival_time=0.0)
        for token in torch.randint(0, len(tokenizer), (200,), generator=generator).tolist():
            seq.output_token_ids.append(token)
            assert not detokenizer.update(seq, is_finished=False)
            full = tokenizer.decode(seq.output_token_ids, skip_special_tokens=skip_special)
            assert seq.text == _stable_prefix(full, ())
        detokenizer.update(seq, is_finished=True)
        assert seq.text == tokenizer.decode(seq.output_token_ids, skip_special_tokens=skip_special)


def test_detokenizer_text_equals_transformers_decode(llama):
    """The detokenizer's fast decode (the Rust tokenizer) gives transformers' text, specials skipped or kept."""
    from transformers import AutoTokenizer

    from kubelora.engine.detokenizer import Detokenizer
    from kubelora.engine.sampling_params import SamplingParams
    from kubelora.engine.sequence import Sequence

    tokenizer = AutoTokenizer.from_pretrained(llama.model_dir)
    detokenizer = Detokenizer(tokenizer)
    gen = torch.Generator().manual_seed(3)
    for skip in (True, False):
        ids = torch.randint(0, tokenizer.vocab_size, (40,), generator=gen).tolist()
        seq = Sequence(request_id="r", prompt_token_ids=[1], params=SamplingParams(skip_special_tokens=skip),
                       adapter_name=None, adapter=None, max_tokens=64, arrival_time=0.0)
        for token in ids:
            seq.output_token_ids.append(token)
            detokenizer.update(seq, is_finished=False)
        detokenizer.update(seq, is_finished=True)
        assert seq.text == tokenizer.decode(ids, skip_special_tokens=skip)
