"""ServerConfig from flags and KUBELORA_* variables: flags win, errors name the setting."""

from __future__ import annotations

import argparse

import pytest

from kubelora.engine.config import EngineConfig
from kubelora.engine.server.config import ENGINE_FIELDS, SETTINGS, ServerConfig, add_arguments, resolve_config

REQUIRED_FLAGS = ["--model", "/m", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "4",
                  "--max-model-len", "256"]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_only():
    config = resolve_config(_parse(REQUIRED_FLAGS + ["--lora", "a=/x", "--lora", "b=/y", "--port", "0"]), {})
    assert config.engine.model_dir == "/m" and config.engine.served_model_name is None
    assert config.lora == (("a", "/x"), ("b", "/y"))
    assert config.port == 0 and config.engine.max_num_seqs == 64 and config.admin_token is None
    assert config.admin_port == 8001
    assert resolve_config(_parse(REQUIRED_FLAGS + ["--admin-port", "9001"]), {}).admin_port == 9001
    assert config.engine == EngineConfig(model_dir="/m", max_loras=2, max_lora_rank=16, max_cpu_loras=4,
                                         max_model_len=256)  # unset engine settings keep EngineConfig's defaults


def test_flags_fill_engine_config_fields():
    config = resolve_config(_parse(REQUIRED_FLAGS + ["--max-waiting-requests", "7", "--strict-base-model",
                                                     "--enforce-eager", "--max-lora-pool-bytes", "4096"]), {})
    engine = config.engine
    assert engine.max_waiting == 7 and engine.is_base_model_strict and engine.enforce_eager
    assert engine.max_lora_pool_bytes == 4096
    env = {"KUBELORA_ENFORCE_EAGER": "true", "KUBELORA_MAX_WAITING_REQUESTS": "9", "KUBELORA_DEVICE": "cuda:1"}
    engine = resolve_config(_parse(REQUIRED_FLAGS), env).engine
    assert engine.enforce_eager and engine.max_waiting == 9 and engine.device == "cuda:1"
    assert not resolve_config(_parse(REQUIRED_FLAGS + ["--no-enforce-eager"]), env).engine.enforce_eager


def test_engine_config_errors_name_the_setting():
    with pytest.raises(ValueError, match=r"--max-waiting-requests \(or KUBELORA_MAX_WAITING_REQUESTS\): max_waiting"):
        resolve_config(_parse(REQUIRED_FLAGS + ["--max-waiting-requests", "0"]), {})
    with pytest.raises(ValueError, match=r"--dtype \(or KUBELORA_DTYPE\)"):
        resolve_config(_parse(REQUIRED_FLAGS), {"KUBELORA_DTYPE": "float8"})


def test_env_fills_in_and_flags_win():
    env = {"KUBELORA_MODEL": "/env-model", "KUBELORA_MAX_LORAS": "3", "KUBELORA_MAX_LORA_RANK": "8",
           "KUBELORA_MAX_CPU_LORAS": "6", "KUBELORA_MAX_MODEL_LEN": "128", "KUBELORA_SERVED_MODEL_NAME": "base",
           "KUBELORA_ADAPTER_ROOT": "/a, /b", "KUBELORA_LORA": "x=/p1,y=/p2", "KUBELORA_ADMIN_TOKEN": "s3cret"}
    config = resolve_config(_parse(["--max-loras", "2"]), env)
    assert config.engine.model_dir == "/env-model" and config.engine.max_loras == 2
    assert config.engine.max_lora_rank == 8 and config.engine.served_model_name == "base"
    assert config.adapter_root == ("/a", "/b")
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
    ({"max_loras": 0}, "max_loras must be an integer in"),
    ({"max_cpu_loras": 1}, "max_cpu_loras"),
    ({"device": "tpu"}, "device must be"),
    ({"device": "cudax"}, "device must be cpu, cuda or cuda:N"),
    ({"lora": (("a", "/x"), ("a", "/y"))}, "unique"),
    ({"lora": (("../x", "/x"),)}, "must match"),
    ({"lora": (("base", "/x"),), "served_model_name": "base"}, "differ from the base"),
    ({"port": 70000}, "port"),
    ({"admin_port": -1}, "admin_port must be in"),
    ({"port": 8000, "admin_port": 8000}, "admin_port must differ from port"),
])
def test_validation(change, match):
    base = dict(model_dir="/m", max_loras=2, max_lora_rank=16, max_cpu_loras=4, max_model_len=256) | change
    with pytest.raises(ValueError, match=match):
        ServerConfig(EngineConfig(**{k: v for k, v in base.items() if k in ENGINE_FIELDS}),
                     **{k: v for k, v in base.items() if k not in ENGINE_FIELDS})


def test_every_setting_is_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "server.md")
    if not doc.exists():
        pytest.skip("docs/server.md not written yet")
    text = doc.read_text()
    missing = [s.env for s in SETTINGS if s.env not in text or s.flag not in text]
    assert not missing, f"undocumented settings: {missing}"
