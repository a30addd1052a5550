"""The sampling API through a real server with the openai SDK (plain HTTP where the SDK has no field):
logprobs and top_logprobs (whole and streamed), echo, prompt_logprobs, n, penalties, logit_bias, min_p,
min_tokens, allowed_token_ids, bad_words, truncate_prompt_tokens, stream_options, and the 400s of each."""

from __future__ import annotations

import math

import pytest
import torch

PROMPT = "Once upon a time there was"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def hf_model(material):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(material.model_dir, dtype=torch.float32).eval()


@pytest.fixture
def server(live_server):
    return live_server()


def _base(server) -> str:
    return server.serving.model_name


def test_completion_logprobs_and_echo_equal_transformers(server, hf_model):
    client = server.client()
    ids = server.encode(PROMPT)
    response = client.completions.create(model=_base(server), prompt=PROMPT, max_tokens=5, logprobs=3, echo=True,
                                         **GREEDY)
    choice = response.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 5 and lp.token_logprobs[0] is None
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], -1)
    for i in range(1, len(ids)):  # the echoed prompt: logprob of prompt token i given the ones before
        assert lp.token_logprobs[i] == pytest.approx(expected[i - 1, ids[i]].item(), abs=1e-4)
    for i in range(len(ids), len(ids) + 5):  # greedy: the chosen token is the most likely one
        assert len(lp.top_logprobs[i]) <= 3
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=1e-6)
    first_generated = lp.token_logprobs[len(ids)]
    assert first_generated == pytest.approx(expected[-1].max().item(), abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_streamed_equal_whole(server):
    client = server.client()
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(model=_base(server), messages=messages, max_tokens=6, logprobs=True,
                                           top_logprobs=2, **GREEDY)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)
    streamed = []
    chunks = client.chat.completions.create(model=_base(server), messages=messages, max_tokens=6, logprobs=True,
                                            top_logprobs=2, stream=True, **GREEDY)
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(t.token, round(t.logprob, 5)) for t in streamed] == [(t.token, round(t.logprob, 5)) for t in content]
    plain = client.chat.completions.create(model=_base(server), messages=messages, max_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_streamed_completion_logprobs_and_continuous_usage(server):
    client = server.client()
    chunks = list(client.completions.create(model=_base(server), prompt=PROMPT, max_tokens=4, logprobs=1,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True,
                                                        "stream_options": {"include_usage": True,
                                                                           "continuous_usage_stats": True}},
                                            temperature=0))
    with_choices = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_choices)
    assert [c.usage.completion_tokens for c in with_choices][-1] == 4
    tokens = [t for c in with_choices if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == 4
    assert chunks[-1].usage.completion_tokens == 4 and not chunks[-1].choices


def test_n_choices(server):
    client = server.client()
    response = client.completions.create(model=_base(server), prompt=[PROMPT, "Hello"], n=3, max_tokens=6,
                                         temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == list(range(6))
    assert len({c.text for c in response.choices[:3]}) > 1  # the n samples of one prompt differ
    prompt_tokens = len(server.encode(PROMPT)) + len(server.encode("Hello"))
    assert response.usage.prompt_tokens == prompt_tokens and response.usage.completion_tokens == 36
    again = client.completions.create(model=_base(server), prompt=[PROMPT, "Hello"], n=3, max_tokens=6,
                                      temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in response.choices]  # seeded: reproducible
    chat = client.chat.completions.create(model=_base(server), messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=4, stream=True, temperature=1.0)
    indices = {c.choices[0].index for c in chat if c.choices}
    assert indices == {0, 1}


def _tokens_of(client, model: str, **kwargs) -> list[str]:
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, logprobs=0, **kwargs)
    return response.choices[0].logprobs.tokens


def test_logit_bias_allowed_bad_words_min_tokens(server):
    client, model = server.client(), _base(server)
    tokenizer = server.serving.engine._engine.tokenizer
    target = server.encode(" dragon")[-1]
    biased = _tokens_of(client, model, temperature=0, logit_bias={str(target): 100})
    assert biased == [tokenizer.decode([target])] * 6
    allowed = [target, target + 1]
    only = _tokens_of(client, model, temperature=1.0, seed=3, extra_body={"allowed_token_ids": allowed})
    assert set(only) <= {tokenizer.decode([t]) for t in allowed}
    free = _tokens_of(client, model, temperature=0, extra_body={"ignore_eos": True})
    banned = _tokens_of(client, model, temperature=0, extra_body={"ignore_eos": True, "bad_words": [free[0]]})
    assert banned[0] != free[0]
    stop_id = server.encode(free[1])[-1]
    at_least = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"min_tokens": 6, "stop_token_ids": [stop_id]})
    assert at_least.usage.completion_tokens >= 6


def test_penalties_and_min_p_change_or_keep_the_output(server):
    client, model = server.client(), _base(server)
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, **GREEDY).choices[0].text
    penalised = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=1.0,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    assert penalised.choices[0].text != base
    kept = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True, "min_p": 0.5})
    assert kept.choices[0].text == base  # min_p never drops the most likely token


def test_prompt_logprobs_and_truncation_over_http(server):
    ids = server.encode(PROMPT)
    status, body = server.post("/v1/completions", {"model": _base(server), "prompt": PROMPT, "max_tokens": 2,
                                                   "prompt_logprobs": 2, "truncate_prompt_tokens": 4})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == 4
    prompt_lp = body["choices"][0]["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == 4
    assert all(str(t) in entry for t, entry in zip(ids[-3:], prompt_lp[1:]))
    assert all(math.isfinite(v["logprob"]) for entry in prompt_lp[1:] for v in entry.values())
    status, body = server.post("/v1/chat/completions", {"model": _base(server), "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "Hi"}],
                                                        "prompt_logprobs": 0, "truncate_prompt_tokens": 3})
    assert status == 200 and body["usage"]["prompt_tokens"] == 3 and len(body["prompt_logprobs"]) == 3


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 65), ("logprobs", 21), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("min_p", 1.5), ("min_tokens", 17), ("logit_bias", {"5": 101}),
    ("logit_bias", {"x": 1}), ("allowed_token_ids", []), ("bad_words", [""]), ("truncate_prompt_tokens", 0),
    ("prompt_logprobs", 21),
])
def test_out_of_range_fields_are_400_naming_the_field(server, field, value):
    status, body = server.post("/v1/completions", {"model": _base(server), "prompt": PROMPT, field: value})
    assert status == 400, body
    assert field in body["error"]["param"] and body["error"]["type"] == "invalid_request_error"


def test_chat_logprob_fields_are_checked(server):
    messages = [{"role": "user", "content": "Hi"}]
    status, body = server.post("/v1/chat/completions", {"model": _base(server), "messages": messages,
                                                        "top_logprobs": 3})
    assert status == 400 and body["error"]["param"] == "top_logprobs"
    status, body = server.post("/v1/chat/completions", {"model": _base(server), "messages": messages,
                                                        "logprobs": True, "top_logprobs": 21})
    assert status == 400 and body["error"]["param"] == "top_logprobs"
    status, body = server.post("/v1/completions", {"model": _base(server), "prompt": PROMPT,
                                                   "logit_bias": {"999999": 1}})
    assert status == 400 and "vocabulary" in body["error"]["message"]
