"""64 concurrent requests over 8 adapters with --max-loras 2, through the openai SDK against a live server.

Every request (completions and chat, streamed and not) must give the same greedy text as the offline
`LLM.generate` for its adapter. Two adapters are registered `known` (preload false) and --max-cpu-loras 4
forces host evictions, so on-demand loads run while other adapters keep generating.
"""

from __future__ import annotations

import asyncio

import pytest

PROMPTS = ["The operator watches the cluster", "Colors of the garden:", "Hello! How are you", "Once upon a time",
           "Kubernetes schedules pods", "A quick brown fox", "The weather today is", "Numbers: one two three"]
MAX_TOKENS = 8
KINDS = ("completion", "completion-stream", "chat", "chat-stream")


@pytest.fixture(scope="module")
def tokenizer(material):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(material.model_dir)


def _chat_tokens(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


async def _one(client, model: str, kind: str, prompt: str) -> str:
    common = dict(model=model, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    messages = [{"role": "user", "content": prompt}]
    if kind == "completion":
        response = await client.completions.create(prompt=prompt, **common)
        assert response.usage.completion_tokens == MAX_TOKENS and response.choices[0].finish_reason == "length"
        return response.choices[0].text
    if kind == "chat":
        response = await client.chat.completions.create(messages=messages, **common)
        assert response.choices[0].message.role == "assistant"
        return response.choices[0].message.content
    if kind == "completion-stream":
        stream = await client.completions.create(prompt=prompt, stream=True, **common)
        parts = [chunk.choices[0].text async for chunk in stream]
        return "".join(parts)
    stream = await client.chat.completions.create(messages=messages, stream=True, **common)
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"
    return "".join(c.choices[0].delta.content or "" for c in chunks)


async def test_64_concurrent_requests_match_offline(material, live_server, reference, tokenizer):
    server = live_server(max_loras=2, max_cpu_loras=4)
    for name, path in material.adapters.items():
        server.load(name, path, preload=name not in ("a6", "a7"))
    models = [None, *material.adapters]
    base = server.serving.model_name
    jobs = [(models[i % len(models)], KINDS[i % len(KINDS)], PROMPTS[i % len(PROMPTS)]) for i in range(64)]
    client = server.async_client(timeout=180)
    texts = await asyncio.gather(*(_one(client, adapter or base, kind, prompt) for adapter, kind, prompt in jobs))
    await client.close()

    for (adapter, kind, prompt), text in zip(jobs, texts):
        tokens = _chat_tokens(tokenizer, prompt) if kind.startswith("chat") else tokenizer.encode(prompt)
        [expected] = reference(adapter, [tokens], MAX_TOKENS)
        assert text == expected, f"{adapter or 'base'} {kind} {prompt!r}"
    snapshot = server.serving.engine.snapshot()
    assert snapshot.num_adapter_loads >= 8 and snapshot.num_host_evictions > 0
    assert not snapshot.num_running and not snapshot.num_waiting
    assert server.get("/ready")[0] == 200
