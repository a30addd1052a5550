"""Structured output on the tiny models: JSON schema, JSON object, regex, choice and EBNF outputs match their
grammar, greedy and sampled, beside unconstrained rows (which the mask leaves untouched)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kubelora.engine import SamplingParams
from kubelora.engine.errors import InvalidRequest
from kubelora.engine.sampler import process_logits, sample
from kubelora.engine.sampling_batch import prepare_sampling
from kubelora.engine.sequence import Sequence
from kubelora.engine.structured import StructuredKind, StructuredOutput
from kubelora.engine.structured.matcher import new_matcher

SCHEMA = {
    "type": "object",
    "properties": {
        # a pattern, not maxLength: xgrammar 0.2.9's length-bounded strings admit raw control characters
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "color", "tags"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,6}@[a-z]{3}\.(com|org)"
CHOICES = ["yes", "no", "maybe so"]


def check_schema(value) -> None:
    """The test schema's rules, spelled out (the repo has no JSON-schema validator dependency)."""
    assert isinstance(value, dict) and set(value) == set(SCHEMA["required"])
    assert isinstance(value["name"], str) and re.fullmatch("[A-Za-z ]{1,8}", value["name"])
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool) and 0 <= value["age"] <= 120
    assert isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(t, str) and re.fullmatch("[a-z]{1,4}", t) for t in value["tags"])


def _generate(llm, spec: StructuredOutput, temperature: float, num: int = 4, **options):
    params = [SamplingParams(max_tokens=120, temperature=temperature, seed=i, structured=spec, **options)
              for i in range(num)]
    prompts = [[1, 40 + 7 * i, 60, 90 + i] for i in range(num)]
    return llm.generate(prompts, params)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llama_llm, temperature):
    for out in _generate(llama_llm, StructuredOutput.json_schema(SCHEMA), temperature):
        assert out.finish_reason == "stop", out.text
        check_schema(json.loads(out.text))


def test_json_object_outputs_parse_as_objects(llama_llm):
    outs = _generate(llama_llm, StructuredOutput(StructuredKind.JSON_OBJECT, ""), 1.0, num=6, top_k=20)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished  # a random model may wander; the ones that end are objects
    for out in finished:
        assert isinstance(json.loads(out.text), dict)
    for out in outs:
        assert out.text.startswith("{")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_outputs_full_match(llama_llm, temperature):
    for out in _generate(llama_llm, StructuredOutput(StructuredKind.REGEX, EMAIL), temperature):
        assert out.finish_reason == "stop" and re.fullmatch(EMAIL, out.text), out.text


def test_choice_outputs_are_options(llama_llm):
    outs = _generate(llama_llm, StructuredOutput.choice(CHOICES), 1.0, num=12)
    assert all(o.text in CHOICES and o.finish_reason == "stop" for o in outs)
    assert len({o.text for o in outs}) > 1  # sampled rows do draw among the options


def test_ebnf_grammar(llama_llm):
    spec = StructuredOutput(StructuredKind.GRAMMAR, 'root ::= "(" [0-9] [0-9]? ")" (" " [a-c])?')
    for out in _generate(llama_llm, spec, 1.0):
        assert out.finish_reason == "stop" and re.fullmatch(r"\([0-9]{1,2}\)( [a-c])?", out.text), out.text


def test_grammar_wins_over_filters_that_leave_nothing(llama_llm):
    """min_tokens bans EOS, and the only token a finished choice allows is EOS: the grammar decides."""
    for out in _generate(llama_llm, StructuredOutput.choice(["ab"]), 0.0, num=2, min_tokens=6):
        assert out.text == "ab" and out.finish_reason == "stop"


def test_constrained_and_free_requests_share_a_batch(llama_llm):
    free = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = [[1, 50 + i, 70] for i in range(6)]
    alone = llama_llm.generate(prompts, [free] * 6)
    spec = StructuredOutput(StructuredKind.REGEX, EMAIL)
    mixed = llama_llm.generate(prompts, [free, SamplingParams(max_tokens=40, temperature=0.0, structured=spec)] * 3)
    assert [o.token_ids for o in mixed[::2]] == [o.token_ids for o in alone[::2]]
    assert all(re.fullmatch(EMAIL, o.text) for o in mixed[1::2])


@pytest.mark.parametrize("spec", [
    StructuredOutput(StructuredKind.REGEX, "[a-", "guided_regex"),
    StructuredOutput(StructuredKind.GRAMMAR, "root ::= missing", "structured_outputs.grammar"),
    StructuredOutput.json_schema({"type": "nope"}, "response_format.json_schema.schema"),
])
def test_invalid_grammar_names_its_field(llama_llm, spec):
    with pytest.raises(InvalidRequest) as err:
        llama_llm.engine.grammars.compile(spec)
    assert err.value.param == spec.param and spec.param in str(err.value)


def test_compilations_are_cached_by_spec(llama_llm):
    grammars = llama_llm.engine.grammars
    first = grammars.compile(StructuredOutput.json_schema(SCHEMA))
    assert grammars.compile(StructuredOutput.json_schema(json.dumps(SCHEMA), param="guided_json")) is first
    spec = grammars.submit(StructuredOutput.choice(CHOICES)).result(timeout=30)
    assert spec.grammar is grammars.compile(StructuredOutput.choice(CHOICES))


def _seq(i: int, params: SamplingParams, grammar=None) -> Sequence:
    return Sequence(request_id=f"r{i}", prompt_token_ids=[1], params=params, adapter_name=None, adapter=None,
                    max_tokens=16, arrival_time=0.0, grammar=grammar)


def test_mask_touches_only_grammar_rows(llama_llm):
    engine = llama_llm.engine
    vocab = engine.model_config.vocab_size
    spec = StructuredOutput.choice(["yes"])
    matcher = new_matcher(engine.grammars.compile(spec))
    free = SamplingParams(temperature=0.0)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    assert prepare_sampling([_seq(0, free), _seq(1, free)], vocab, logits.device).is_plain_greedy
    seqs = [_seq(0, free), _seq(1, SamplingParams(temperature=0.0, structured=spec), matcher), _seq(2, free)]
    batch = prepare_sampling(seqs, vocab, logits.device)
    out = process_logits(logits, batch)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    first = engine.tokenizer.encode("yes", add_special_tokens=False)[0]
    assert first in allowed and all(engine.tokenizer.decode([t]) in ("y", "ye", "yes") for t in allowed)
    assert sample(logits, batch).token_ids[1] in allowed


def test_greedy_grammar_rows_sample_as_the_processed_logits(llama_llm):
    """The greedy grammar-only shortcut (no copy of every row) picks what the argmax of process_logits picks, with
    several grammar rows filled by xgrammar's batch call beside free rows."""
    from kubelora.engine.structured.matcher import fill_bitmask

    engine = llama_llm.engine
    vocab = engine.model_config.vocab_size
    specs = [StructuredOutput.choice(["yes", "no"]), StructuredOutput(StructuredKind.REGEX, r"[0-9]{3}"),
             StructuredOutput.json_schema(SCHEMA)]
    matchers = [new_matcher(engine.grammars.compile(spec)) for spec in specs]
    single = [fill_bitmask([m], vocab) for m in matchers]
    assert torch.equal(fill_bitmask(matchers, vocab), torch.cat(single))
    free = SamplingParams(temperature=0.0)
    seqs = [_seq(0, free)] + [_seq(1 + i, SamplingParams(temperature=0.0, structured=spec), m)
                              for i, (spec, m) in enumerate(zip(specs, matchers))] + [_seq(4, free)]
    batch = prepare_sampling(seqs, vocab, torch.device("cpu"))
    assert batch.is_greedy_grammar_only
    for seed in range(3):
        logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(seed))
        expected = process_logits(logits, batch).argmax(dim=-1).tolist()
        assert sample(logits, batch).token_ids == expected
    penalized = prepare_sampling(seqs[:2] + [_seq(5, SamplingParams(temperature=0.0, presence_penalty=1.0))],
                                 vocab, torch.device("cpu"))
    assert not penalized.is_greedy_grammar_only
