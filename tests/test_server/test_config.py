"""ServerConfig from flags and KUBELORA_* variables: flags win, errors name the setting."""

from __future__ import annotations

import argparse

import pytest

from kubelora.engine.server.config import SETTINGS, ServerConfig, add_arguments, resolve_config

REQUIRED_FLAGS = ["--model", "/m", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "4",
                  "--max-model-len", "256"]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_only():
    config = resolve_config(_parse(REQUIRED_FLAGS + ["--lora", "a=/x", "--lora", "b=/y", "--port", "0"]), {})
    assert config.model == "/m" and config.served_model_name is None
    assert config.lora == (("a", "/x"), ("b", "/y"))
    assert config.port == 0 and config.max_num_seqs == 64 and config.admin_token is None


def test_env_fills_in_and_flags_win():
    env = {"KUBELORA_MODEL": "/env-model", "KUBELORA_MAX_LORAS": "3", "KUBELORA_MAX_LORA_RANK": "8",
           "KUBELORA_MAX_CPU_LORAS": "6", "KUBELORA_MAX_MODEL_LEN": "128", "KUBELORA_SERVED_MODEL_NAME": "base",
           "KUBELORA_ADAPTER_ROOT": "/a, /b", "KUBELORA_LORA": "x=/p1,y=/p2", "KUBELORA_ADMIN_TOKEN": "s3cret"}
    config = resolve_config(_parse(["--max-loras", "2"]), env)
    assert config.model == "/env-model" and config.max_loras == 2 and config.max_lora_rank == 8
    assert config.served_model_name == "base" and config.adapter_root == ("/a", "/b")
    assert config.lora == (("x", "/p1"), ("y", "/p2"))
    assert config.admin_token == "s3cret" and "s3cret" not in repr(config)


def test_token_file(tmp_path):
    token = tmp_path / "token"
    token.write_text("abc\n")
    config = resolve_config(_parse(REQUIRED_FLAGS + ["--admin-token-file", str(token)]), {})
    assert config.admin_token == "abc"
    token.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        resolve_config(_parse(REQUIRED_FLAGS + ["--admin-token-file", str(token)]), {})


def test_missing_required_names_flag_and_env():
    with pytest.raises(ValueError, match=r"--max-model-len \(or KUBELORA_MAX_MODEL_LEN\)"):
        resolve_config(_parse(REQUIRED_FLAGS[:-2]), {})


def test_bad_env_value_names_variable():
    with pytest.raises(ValueError, match="KUBELORA_PORT"):
        resolve_config(_parse(REQUIRED_FLAGS), {"KUBELORA_PORT": "eighty"})


@pytest.mark.parametrize("change, match", [
    ({"max_loras": 0}, "max_loras must be >= 1"),
    ({"max_cpu_loras": 1}, "max_cpu_loras"),
    ({"device": "tpu"}, "device must be cpu, cuda or cuda:N"),
    ({"lora": (("a", "/x"), ("a", "/y"))}, "unique"),
    ({"lora": (("../x", "/x"),)}, "must match"),
    ({"port": 70000}, "port"),
])
def test_validation(change, match):
    base = dict(model="/m", max_loras=2, max_lora_rank=16, max_cpu_loras=4, max_model_len=256)
    with pytest.raises(ValueError, match=match):
        ServerConfig(**(base | change))


def test_every_setting_is_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "server.md")
    if not doc.exists():
        pytest.skip("docs/server.md not written yet")
    text = doc.read_text()
    missing = [s.env for s in SETTINGS if s.env not in text or s.flag not in text]
    assert not missing, f"undocumented settings: {missing}"
