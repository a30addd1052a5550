"""Request parsing at the edge: types, ranges and unknown fields give 400s that name the field."""

from __future__ import annotations

import pytest

from kubelora.contract.errors import InvalidRequest
from kubelora.contract.http_errors import to_http
from kubelora.engine.server.json_body import decode_json_object
from kubelora.engine.server.protocol import (parse_chat, parse_completion, parse_load_adapter,
                                             parse_unload_adapter)


def test_completion_defaults():
    req = parse_completion({"model": "m", "prompt": "hi"})
    assert req.prompts == ("hi",) and not req.is_stream and req.sampling.max_tokens == 16
    params = req.sampling.to_params()
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.stop == ()


def test_completion_full():
    req = parse_completion({"model": "m", "prompt": [[1, 2], "x"], "max_tokens": 4, "temperature": 0,
                            "top_p": 0.5, "top_k": -1, "seed": 7, "stop": "\n", "stream": True,
                            "stream_options": {"include_usage": True}, "n": 1, "user": "u", "logprobs": None})
    assert req.prompts == ((1, 2), "x") and req.is_stream and req.include_usage
    assert req.sampling.stop == ("\n",) and req.sampling.top_k == 0 and req.sampling.seed == 7


def test_token_prompt_is_one_prompt():
    assert parse_completion({"model": "m", "prompt": [5, 6, 7]}).prompts == ((5, 6, 7),)


@pytest.mark.parametrize("body, param, code", [
    ({"prompt": "x"}, "model", "missing_field"),
    ({"model": "m"}, "prompt", "missing_field"),
    ({"model": "m", "prompt": ""}, "prompt", "invalid_value"),
    ({"model": "m", "prompt": []}, "prompt", "invalid_type"),
    ({"model": "m", "prompt": ["ok", ""]}, "prompt", "invalid_value"),
    ({"model": 3, "prompt": "x"}, "model", "invalid_type"),
    ({"model": "m", "prompt": "x", "max_tokens": "8"}, "max_tokens", "invalid_type"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens", "out_of_range"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens", "invalid_type"),
    ({"model": "m", "prompt": "x", "temperature": 3}, "temperature", "out_of_range"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p", "out_of_range"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream", "invalid_type"),
    ({"model": "m", "prompt": "x", "stop": [1]}, "stop", "invalid_type"),
    ({"model": "m", "prompt": "x", "n": 0}, "n", "out_of_range"),
    ({"model": "m", "prompt": ["a", "b"], "n": 33}, "n", "out_of_range"),
    ({"model": "m", "prompt": "x", "max_token": 2}, "max_token", "unknown_field"),
    ({"model": "m", "prompt": "x", "stream_options": {"bogus": 1}}, "stream_options.bogus", "unknown_field"),
])
def test_completion_errors_name_the_field(body, param, code):
    with pytest.raises(InvalidRequest) as info:
        parse_completion(body)
    assert info.value.param == param and info.value.code == code and to_http(info.value).status == 400
    assert param.split(".")[-1] in info.value.message


def test_chat():
    req = parse_chat({"model": "a", "messages": [{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                      "max_completion_tokens": 5, "stream": True})
    assert [m.content for m in req.messages] == ["be brief", "hi"] and req.sampling.max_tokens == 5
    assert parse_chat({"model": "a", "messages": [{"role": "user", "content": "x"}]}).sampling.max_tokens is None


@pytest.mark.parametrize("body, param", [
    ({"model": "a", "messages": []}, "messages"),
    ({"model": "a", "messages": "hi"}, "messages"),
    ({"model": "a", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "a", "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": "a", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"model": "a", "messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
    ({"model": "a", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
])
def test_chat_errors(body, param):
    with pytest.raises(InvalidRequest) as info:
        parse_chat(body)
    assert info.value.param == param


def test_decode_json():
    assert decode_json_object(b'{"a": 1}') == {"a": 1}
    for raw in (b"{", b"[1]", b"\xff", b""):
        with pytest.raises(InvalidRequest) as info:
            decode_json_object(raw)
        assert info.value.code == "invalid_json"


def test_load_and_unload_bodies():
    req = parse_load_adapter({"lora_name": "t-1", "lora_path": "/a", "load_inplace": True, "lora_int_id": 3})
    assert req.lora_name == "t-1" and req.is_inplace and req.is_preload and req.sha256 is None
    assert not parse_load_adapter({"lora_name": "t", "lora_path": "/a", "preload": False}).is_preload
    assert parse_unload_adapter({"lora_name": "t"}).lora_name == "t"
    for body, param in [({"lora_path": "/a"}, "lora_name"), ({"lora_name": "../x", "lora_path": "/a"}, "lora_name"),
                        ({"lora_name": "t", "lora_path": "/a", "sha256": "zz"}, "sha256"),
                        ({"lora_name": "t", "lora_path": "/a", "load_inplace": "yes"}, "load_inplace")]:
        with pytest.raises(InvalidRequest) as info:
            parse_load_adapter(body)
        assert info.value.param == param
