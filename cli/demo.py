"""`kubelora demo`: a tiny model, several LoRA adapters, one mixed batch, each adapter's output printed."""

from __future__ import annotations

import tempfile
from pathlib import Path

# (name, rank, alpha, targets): different ranks and target sets, served together in one batch.
DEMO_ADAPTERS = (
    ("tenant-a", 4, 8, "q_proj,v_proj"),
    ("tenant-b", 8, 16, "q_proj,k_proj,v_proj,o_proj"),
    ("tenant-c", 16, 16, "all-linear"),
)
DEMO_PROMPTS = ("The operator watches the cluster", "Colors of the garden:", "Hello! How are you")


def build_demo_material(workdir: Path) -> tuple[Path, dict[str, Path]]:
    from kubelora.cli.tiny import make_adapter, make_tiny_model

    model_dir = workdir / "model"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, arch="llama", seed=0)
    adapters = {}
    for seed, (name, rank, alpha, targets) in enumerate(DEMO_ADAPTERS, start=1):
        path = workdir / "adapters" / name
        if not (path / "adapter_config.json").exists():
            make_adapter(path, model_dir, rank=rank, alpha=alpha, targets=targets, seed=seed)
        adapters[name] = path
    return model_dir, adapters


def run_demo(workdir: str | None = None, device: str = "cpu") -> int:
    from kubelora.engine import LLM, SamplingParams

    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="kubelora-demo-"))
    model_dir, adapters = build_demo_material(root)
    llm = LLM(str(model_dir), max_loras=len(adapters), max_lora_rank=16, max_cpu_loras=8, device=device)
    for name, path in adapters.items():
        llm.load_adapter(name, str(path))
    names: list[str | None] = [None, *adapters]
    prompts = [prompt for prompt in DEMO_PROMPTS for _ in names]
    chosen = [name for _ in DEMO_PROMPTS for name in names]
    results = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), adapters=chosen)
    print(f"model: {model_dir}  ({len(prompts)} requests, {len(adapters)} adapters + base, one batch)")
    for prompt, name, result in zip(prompts, chosen, results):
        print(f"[{name or 'base':>9}] {prompt!r} -> {result.text!r} ({result.finish_reason})")
    return 0
