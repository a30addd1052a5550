"""kubelora data plane: model, scheduler, adapters, OpenAI-compatible server.

Heavy modules (torch, transformers) load on first use of an exported name, so `kubelora.engine.errors` and
`kubelora.engine.config` stay cheap to import.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "kubelora.engine.llm",
    "LLMEngine": "kubelora.engine.engine",
    "EngineConfig": "kubelora.engine.config",
    "SamplingParams": "kubelora.engine.sampling_params",
    "RequestOutput": "kubelora.engine.outputs",
    "GenerationResult": "kubelora.engine.outputs",
    "EngineSnapshot": "kubelora.engine.outputs",
    "AdapterManager": "kubelora.engine.adapters.manager",
    "AdapterInfo": "kubelora.engine.adapters.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kubelora.engine' has no attribute {name!r}")
