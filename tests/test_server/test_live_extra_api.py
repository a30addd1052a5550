"""`GET /v1/models/{id}`, `POST /tokenize`, `POST /detokenize`, `GET /version`, and chat
`continue_final_message` / `chat_template_kwargs`, through a real server (openai SDK where it has the call)."""

from __future__ import annotations

import importlib.metadata
import json
import shutil

import openai
import pytest

# Written here: shows a template variable (`style`) and the tools, so their effect is visible in the text.
TEMPLATE = (
    "{{ bos_token }}{% if style is defined %}<|system|>style={{ style }}<|end|>{% endif %}"
    "{% if tools %}<|system|>{{ tools | tojson }}<|end|>{% endif %}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
USER = {"role": "user", "content": "Tell me a story"}


@pytest.fixture(scope="module")
def model_dir(material, tmp_path_factory):
    dst = tmp_path_factory.mktemp("kwargs-model") / "model"
    shutil.copytree(material.model_dir, dst)
    (dst / "chat_template.jinja").write_text(TEMPLATE)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture
def server(live_server, model_dir):
    return live_server(model_dir=str(model_dir))


def _text(server, body: dict) -> tuple[dict, str]:
    status, tokenized = server.post("/tokenize", body)
    assert status == 200, tokenized
    status, detokenized = server.post("/detokenize", {"tokens": tokenized["tokens"]})
    assert status == 200, detokenized
    return tokenized, detokenized["prompt"]


def test_model_retrieve(server, material):
    client = server.client()
    base = client.models.retrieve(server.serving.model_name)
    assert base.id == server.serving.model_name and base.model_extra["max_model_len"] == 512
    server.load("org/tenant-a", material.adapters["a0"])
    adapter = client.models.retrieve("org/tenant-a")
    listed = next(c for c in client.models.list().data if c.id == "org/tenant-a")
    assert adapter.model_dump() == listed.model_dump()  # the same card (and redaction) as the list
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("nobody")
    assert info.value.body["code"] == "model_not_found" and info.value.body["type"] == "not_found_error"


def test_tokenize_prompt(server):
    ids = server.encode("Once upon a time")
    status, body = server.post("/tokenize", {"prompt": "Once upon a time", "return_token_strs": True})
    assert status == 200 and body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] == 512
    assert len(body["token_strs"]) == len(ids)
    _, plain = server.post("/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False,
                                         "model": server.serving.model_name})
    assert plain["token_strs"] is None and plain["tokens"] == ids  # the tiny tokenizer adds no BOS of its own
    status, body = server.post("/detokenize", {"tokens": ids})
    assert status == 200 and "Once upon a time" in body["prompt"]


def test_tokenize_chat_renders_tools_and_kwargs(server):
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    tokenized, text = _text(server, {"messages": [USER], "tools": tools, "chat_template_kwargs": {"style": "terse"}})
    assert text == ("<s><|system|>style=terse<|end|><|system|>" + json.dumps(tools) +
                    "<|end|><|user|>Tell me a story<|end|><|assistant|>")
    # The chat endpoint renders the same prompt.
    response = server.client().chat.completions.create(
        model=server.serving.model_name, messages=[USER], tools=tools, max_tokens=2,
        extra_body={"chat_template_kwargs": {"style": "terse"}})
    assert response.usage.prompt_tokens == tokenized["count"]


def test_continue_final_message(server):
    messages = [USER, {"role": "assistant", "content": "Once upon a"}]
    tokenized, text = _text(server, {"messages": messages, "add_generation_prompt": False,
                                     "continue_final_message": True})
    assert text == "<s><|user|>Tell me a story<|end|><|assistant|>Once upon a"  # open: no <|end|>, no new turn
    response = server.client().chat.completions.create(
        model=server.serving.model_name, messages=messages, max_tokens=3, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True})
    assert response.usage.prompt_tokens == tokenized["count"] and response.usage.completion_tokens == 3


@pytest.mark.parametrize("extra, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt defaults to true
    ({"continue_final_message": True, "add_generation_prompt": False, "final_user": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"not-an-identifier": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
])
def test_chat_template_fields_refused(server, extra, param):
    messages = [USER] if extra.pop("final_user", False) else [USER, {"role": "assistant", "content": "Once"}]
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model=server.serving.model_name, messages=messages, max_tokens=2,
                                                extra_body=extra)
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"
    status, body = server.post("/tokenize", {"messages": messages, **extra})
    assert status == 400 and body["error"]["param"] == param


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [USER]}, 400, "prompt"),
    ("/tokenize", {"prompt": ["x"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "nobody"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"prompt": "a\ud800b"}, 400, "prompt"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10 ** 6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1] * 513}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_tokenize_errors(server, path, body, status, param):
    got, answer = server.post(path, body)
    assert got == status and answer["error"]["param"] == param, answer


def test_tokenize_is_bounded(server):
    huge = "ab" * (server.serving.prompts.max_chars // 2 + 1)  # past the character bound: no tokenizing at all
    status, body = server.post("/tokenize", {"prompt": huge})
    assert status == 413 and body["error"]["type"] == "prompt_too_long"
    status, body = server.post("/tokenize", {"messages": [{"role": "user", "content": huge}]})
    assert status == 413 and body["error"]["param"] == "messages"


def test_version(server):
    status, raw = server.get("/version")
    assert status == 200 and json.loads(raw) == {"version": importlib.metadata.version("kubelora")}
