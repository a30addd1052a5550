"""The sampling stage against transformers: penalties, min_p, logit bias, bad words and min_tokens equal its
logits processors on the same inputs; logprobs equal log_softmax of transformers+PEFT logits."""

from __future__ import annotations

import pytest
import torch

from kubelora.engine import SamplingParams
from kubelora.engine.sampler import LOGPROB_FLOOR, apply_min_p, process_logits, sample

VOCAB = 64
EOS = 2


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _histories(num_rows: int, length: int, seed: int = 1) -> list[list[int]]:
    return torch.randint(0, VOCAB, (num_rows, length), generator=torch.Generator().manual_seed(seed)).tolist()


def test_repetition_penalty_equals_transformers(sampling_batch):
    from transformers import RepetitionPenaltyLogitsProcessor

    logits, prompts, outputs = _logits(4), _histories(4, 6, 1), _histories(4, 5, 2)
    penalties = [1.3, 1.0, 0.7, 2.0]
    params = [SamplingParams(temperature=0.0, repetition_penalty=r) for r in penalties]
    ours = process_logits(logits, sampling_batch(logits, params, outputs=outputs, prompts=prompts))
    for row, r in enumerate(penalties):
        ids = torch.tensor([prompts[row] + outputs[row]])
        expected = RepetitionPenaltyLogitsProcessor(r)(ids, logits[row : row + 1].clone())[0]
        torch.testing.assert_close(ours[row], expected)


def test_presence_and_frequency_penalties_follow_openai(sampling_batch):
    """OpenAI: logit - count * frequency_penalty - (count > 0) * presence_penalty, over generated tokens only."""
    logits, prompts, outputs = _logits(3), _histories(3, 8, 3), _histories(3, 12, 4)
    settings = [(0.5, 0.0), (0.0, 1.5), (-1.0, 0.7)]
    params = [SamplingParams(presence_penalty=p, frequency_penalty=f) for p, f in settings]
    ours = process_logits(logits, sampling_batch(logits, params, outputs=outputs, prompts=prompts))
    for row, (presence, frequency) in enumerate(settings):
        counts = torch.bincount(torch.tensor(outputs[row]), minlength=VOCAB).float()
        expected = logits[row] - frequency * counts - presence * (counts > 0).float()
        torch.testing.assert_close(ours[row], expected)


def test_min_p_equals_transformers():
    from transformers import MinPLogitsWarper

    logits = _logits(3, seed=5)
    for min_p in (0.05, 0.3, 0.9):
        expected = MinPLogitsWarper(min_p)(None, logits.clone())
        ours = apply_min_p(logits, torch.full((3,), min_p))
        assert torch.equal(torch.isinf(ours), torch.isinf(expected)), min_p


def test_logit_bias_equals_sequence_bias(sampling_batch):
    from transformers import SequenceBiasLogitsProcessor

    logits = _logits(2, seed=6)
    bias = {3: 5.0, 10: -100.0, 40: 2.5}
    params = [SamplingParams(logit_bias=bias), SamplingParams()]
    ours = process_logits(logits, sampling_batch(logits, params))
    processor = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    expected = processor(torch.tensor([[1]]), logits[:1].clone())[0]
    torch.testing.assert_close(ours[0], expected)
    torch.testing.assert_close(ours[1], logits[1])


def test_bad_words_equal_transformers(sampling_batch):
    from transformers import NoBadWordsLogitsProcessor

    logits = _logits(3, seed=7)
    bad = ((5,), (7, 8), (9, 10, 11))
    outputs = [[1, 3, 7], [4, 9, 10], [8, 7, 6]]  # ends with 7 -> ban 8; ends with 9, 10 -> ban 11; neither
    params = [SamplingParams(bad_words_token_ids=bad)] * 3
    ours = process_logits(logits, sampling_batch(logits, params, outputs=outputs))
    processor = NoBadWordsLogitsProcessor([list(w) for w in bad], eos_token_id=EOS)
    for row in range(3):
        expected = processor(torch.tensor([[1] + outputs[row]]), logits[row : row + 1].clone())[0]
        assert torch.equal(torch.isinf(ours[row]), torch.isinf(expected)), row


def test_min_tokens_equals_min_new_tokens_processor(sampling_batch):
    from transformers import MinNewTokensLengthLogitsProcessor

    logits = _logits(3, seed=8)
    outputs = [[4], [4, 5, 6], [4, 5, 6, 7, 8]]
    params = [SamplingParams(min_tokens=4, stop_token_ids=(9,))] * 3
    ours = process_logits(logits, sampling_batch(logits, params, outputs=outputs, eos=(EOS,)))
    processor = MinNewTokensLengthLogitsProcessor(1, 4, eos_token_id=[EOS, 9])
    for row in range(3):
        expected = processor(torch.tensor([[1] + outputs[row]]), logits[row : row + 1].clone())[0]
        torch.testing.assert_close(ours[row], expected)


def test_allowed_token_ids_keep_only_those(sampling_batch):
    logits = _logits(2, seed=9)
    params = [SamplingParams(allowed_token_ids=(3, 30)), SamplingParams()]
    ours = process_logits(logits, sampling_batch(logits, params))
    assert torch.isfinite(ours[0]).nonzero().flatten().tolist() == [3, 30]
    torch.testing.assert_close(ours[1], logits[1])


def test_rows_are_independent_of_their_batch(sampling_batch):
    """Each row's processed logits and logprobs equal those of the row alone (no cross-row leakage)."""
    logits, prompts, outputs = _logits(4, seed=10), _histories(4, 5, 11), _histories(4, 7, 12)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.4, logprobs=3),
              SamplingParams(temperature=0.0, logit_bias={1: 3.0}, min_tokens=9),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, bad_words_token_ids=((outputs[3][-1], 6),), frequency_penalty=1.0,
                             logprobs=0)]
    together = sample(logits, sampling_batch(logits, params, outputs=outputs, prompts=prompts, eos=(EOS,)))
    for row in range(4):
        alone = sample(logits[row : row + 1],
                       sampling_batch(logits[row : row + 1], params[row : row + 1], outputs=outputs[row : row + 1],
                                      prompts=prompts[row : row + 1], eos=(EOS,)))
        assert together.token_ids[row] == alone.token_ids[0]
        assert together.logprobs[row] == alone.logprobs[0]
    assert together.logprobs[2] is None and len(together.logprobs[0].top_ids) == 3
    assert together.logprobs[3].top_ids == ()


def test_plain_greedy_builds_no_tensors(sampling_batch):
    logits = _logits(3)
    batch = sampling_batch(logits, [SamplingParams(temperature=0.0)] * 3)
    assert batch.is_plain_greedy and batch.temperature is None and batch.penalties is None
    assert sample(logits, batch).token_ids == logits.argmax(-1).tolist()


def test_logprobs_are_of_the_raw_distribution_and_floored(sampling_batch):
    logits = _logits(1, seed=13)
    params = [SamplingParams(temperature=0.0, logprobs=5, allowed_token_ids=(17,))]
    out = sample(logits, sampling_batch(logits, params))
    expected = torch.log_softmax(logits[0], -1)
    assert out.token_ids == [17]
    assert out.logprobs[0].logprob == pytest.approx(expected[17].item(), abs=1e-5)
    assert list(out.logprobs[0].top_ids) == expected.topk(5).indices.tolist()
    big = torch.full((1, VOCAB), float("-inf"))
    big[0, 0] = 0.0
    floored = sample(big, sampling_batch(big, [SamplingParams(temperature=0.0, logprobs=2)]))
    assert floored.logprobs[0].top_logprobs[1] == LOGPROB_FLOOR


# ---- through the engine, against transformers + PEFT on the same weights and adapter ----

@pytest.fixture(scope="module")
def reference(llama):
    """transformers + PEFT with the r8-all adapter (disabled for the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(llama.model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, llama.adapters["r8-all"], adapter_name="r8-all").eval()


def reference_logits(model, adapter: str | None, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                return model(torch.tensor([token_ids])).logits[0]
        return model(torch.tensor([token_ids])).logits[0]


@pytest.mark.parametrize("adapter", [None, "r8-all"])
def test_engine_logprobs_equal_transformers_peft(llama_llm, reference, prompt_ids, adapter):
    prompt = prompt_ids(6, 9)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True, logprobs=4, prompt_logprobs=3)
    result = llama_llm.generate([prompt], params, adapters=[adapter])[0]
    expected = torch.log_softmax(reference_logits(reference, adapter, prompt + result.token_ids[:-1]), -1)
    assert len(result.logprobs) == len(result.token_ids) and len(result.prompt_logprobs) == len(prompt) - 1
    for i, (token, entry) in enumerate(zip(result.token_ids, result.logprobs)):
        row = expected[len(prompt) - 1 + i]
        assert entry.chosen.token_id == token and entry.chosen.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert [t.token_id for t in entry.top] == row.topk(4).indices.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(row.topk(4).values.tolist(), abs=1e-4)
    for i, entry in enumerate(result.prompt_logprobs):  # entry i is prompt token i + 1
        row = expected[i]
        assert entry.chosen.token_id == prompt[i + 1]
        assert entry.chosen.logprob == pytest.approx(row[prompt[i + 1]].item(), abs=1e-4)
        assert [t.token_id for t in entry.top] == row.topk(3).indices.tolist()


def test_engine_prompt_logprobs_over_chunked_prefill(llama, prompt_ids):
    """A prompt split over several prefill chunks gets each prompt position once."""
    from kubelora.engine import LLM

    llm = LLM(llama.model_dir, max_loras=2, max_lora_rank=32, max_num_batched_tokens=8)
    try:
        prompt = prompt_ids(7, 21)
        params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1, return_logits=True)
        result = llm.generate([prompt], params)[0]
    finally:
        llm.close()
    expected = torch.log_softmax(result.prompt_logits, -1)
    assert [e.chosen.token_id for e in result.prompt_logprobs] == prompt[1:]
    got = torch.tensor([e.chosen.logprob for e in result.prompt_logprobs])
    torch.testing.assert_close(got, expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])])


def test_engine_greedy_with_penalties_follows_transformers_processors(llama_llm, prompt_ids):
    """Each greedy token is the argmax of transformers' processors applied to the engine's raw logits."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    prompt = prompt_ids(8, 7)
    bias = {11: 4.0, 12: -3.0}
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.8,
                            logit_bias=bias, return_logits=True)
    result = llama_llm.generate([prompt], params, adapters=["r4-qv"])[0]
    processors = LogitsProcessorList([SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}),
                                      RepetitionPenaltyLogitsProcessor(1.8)])
    for i, token in enumerate(result.token_ids):
        ids = torch.tensor([prompt + result.token_ids[:i]])
        assert processors(ids, result.logits[i : i + 1].clone()).argmax().item() == token, i


def test_engine_token_constraints(llama_llm, prompt_ids):
    prompt = prompt_ids(9, 6)
    free = llama_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    allowed = (free.token_ids[0], 40, 41)
    only = llama_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=1, ignore_eos=True,
                                                       allowed_token_ids=allowed))[0]
    assert set(only.token_ids) <= set(allowed)
    banned = llama_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                         bad_words_token_ids=((free.token_ids[0],),)))[0]
    assert free.token_ids[0] not in banned.token_ids
    stop = free.token_ids[2]
    at_least = llama_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, min_tokens=5,
                                                           stop_token_ids=(stop,)))[0]
    assert len(at_least.token_ids) >= 5 and stop not in at_least.token_ids[:5]


def test_engine_refuses_token_ids_outside_the_vocabulary(llama_llm, prompt_ids):
    from kubelora.engine.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="vocabulary"):
        llama_llm.engine.add_request("bad", prompt_ids(1, 4), SamplingParams(logit_bias={10**6: 1.0}))
