"""Random multi-LoRA problems with float64 expectations: shared by the kernel tests and the GPU sweep."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubelora.kernels.lora import LoRAProj, LoRAStep, prepare_lora_proj, prepare_lora_step

# Relative error bounds per row of y against float64 (output dtype rounding plus operand rounding of t).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DISTRIBUTIONS = ("one", "distinct", "uniform", "zipf", "segments")


@dataclass
class Problem:
    x: torch.Tensor  # [num_tokens, in_dim]
    y0: torch.Tensor  # [num_tokens, sum widths]: y before the op, of the same scale as the LoRA delta
    lora_a: list[torch.Tensor]
    lora_b: list[torch.Tensor]
    proj: LoRAProj
    step: LoRAStep
    slots: list[int]
    ranks: list[list[int]]  # [num_adapters][num_slices]
    row_start: list[list[int]]
    scale: list[list[float]]


def draw_slots(gen: torch.Generator, num_tokens: int, num_adapters: int, dist: str, no_adapter: float) -> list[int]:
    if dist == "one":
        slots = torch.zeros(num_tokens, dtype=torch.int64)
    elif dist == "distinct":
        slots = torch.randperm(num_tokens, generator=gen) % num_adapters
    elif dist in ("uniform", "zipf"):
        weights = torch.ones(num_adapters) if dist == "uniform" else 1.0 / torch.arange(1, num_adapters + 1) ** 1.2
        slots = torch.multinomial(weights, num_tokens, replacement=True, generator=gen)
    else:  # segments: consecutive runs of one slot each, like a prefill batch
        cuts = sorted(torch.randint(0, num_tokens + 1, (num_adapters - 1,), generator=gen).tolist())
        lengths = [b - a for a, b in zip([0] + cuts, cuts + [num_tokens])]
        slots = torch.cat([torch.full((n,), a, dtype=torch.int64) for a, n in enumerate(lengths)])
    drop = torch.rand(num_tokens, generator=gen) < no_adapter
    return torch.where(drop, -1, slots).tolist()


def build_problem(num_tokens: int, ranks: list[list[int]], widths: list[int], in_dim: int, dist: str,
                  dtype: torch.dtype, seed: int, device: torch.device | str, no_adapter: float = 0.0) -> Problem:
    """Random pools with the adapters at their own ranks, in shuffled order with unused rows between them."""
    gen = torch.Generator().manual_seed(seed)
    num_adapters = len(ranks)
    row_start = [[0] * len(widths) for _ in ranks]
    lora_a, lora_b = [], []
    for s, width in enumerate(widths):
        row = int(torch.randint(0, 3, (1,), generator=gen))
        for a in torch.randperm(num_adapters, generator=gen).tolist():
            row_start[a][s] = row
            row += ranks[a][s] + int(torch.randint(0, 3, (1,), generator=gen))
        lora_a.append(torch.randn(row + 1, in_dim, generator=gen) / in_dim**0.5)
        lora_b.append(torch.randn(row + 1, width, generator=gen))
    scale = (torch.rand(num_adapters, len(widths), generator=gen) + 0.5).tolist()
    slots = draw_slots(gen, num_tokens, num_adapters, dist, no_adapter)
    x = torch.randn(num_tokens, in_dim, generator=gen)
    y0 = torch.randn(num_tokens, sum(widths), generator=gen) * 2
    # Poison: -0.0 + 0.0 is +0.0, so an element that should be untouched but is rewritten shows in its bits.
    y0[torch.rand(y0.shape, generator=gen) < 0.2] = -0.0
    to = dict(device=device, dtype=dtype)
    return Problem(
        x=x.to(**to), y0=y0.to(**to), lora_a=[a.to(**to) for a in lora_a], lora_b=[b.to(**to) for b in lora_b],
        proj=prepare_lora_proj(row_start, ranks, scale, device), step=prepare_lora_step(slots, num_adapters, device),
        slots=slots, ranks=ranks, row_start=row_start, scale=scale,
    )


def expected_y(p: Problem) -> torch.Tensor:
    """float64: y0[t, slice s] + scale[a,s] * (x[t] @ A_{a,s}^T) @ B_{a,s}^T, computed per token."""
    y = p.y0.double().clone()
    slots = torch.tensor(p.slots, device=p.x.device)
    offset = 0
    for s, (a_pool, b_pool) in enumerate(zip(p.lora_a, p.lora_b)):
        width = b_pool.shape[1]
        for a, ranks in enumerate(p.ranks):
            tokens = torch.nonzero(slots == a).flatten()
            rows = slice(p.row_start[a][s], p.row_start[a][s] + ranks[s])
            if ranks[s] and tokens.numel():
                delta = p.x[tokens].double() @ a_pool[rows].double().T @ b_pool[rows].double()
                y[tokens, offset : offset + width] += p.scale[a][s] * delta
        offset += width
    return y


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def check_y(p: Problem, y: torch.Tensor) -> None:
    """Untouched where specified (bit for bit), within the dtype's tolerance row by row elsewhere."""
    expected = expected_y(p)
    slots = torch.tensor(p.slots, device=y.device)
    ranks = torch.tensor(p.ranks, device=y.device).reshape(len(p.ranks), -1)  # [num_adapters, num_slices]
    widths = torch.tensor([b.shape[1] for b in p.lora_b], device=y.device)
    token_ranks = torch.where(slots[:, None] >= 0, ranks[slots.clamp(min=0)], 0)  # [num_tokens, num_slices]
    touched = torch.repeat_interleave(token_ranks > 0, widths, dim=1)  # [num_tokens, total width]
    assert torch.equal(as_bits(y[~touched]), as_bits(p.y0[~touched])), "y rewritten where no adapter applies"
    assert not torch.isnan(y).any(), "NaN in y"
    err = torch.where(touched, y.double() - expected, 0).norm(dim=1)
    ref = torch.where(touched, expected, 0).norm(dim=1)
    worst = float((err / ref.clamp(min=1e-30)).max()) if touched.any() else 0.0
    assert worst <= TOLERANCE[y.dtype], f"worst row relative error {worst:.2e} > {TOLERANCE[y.dtype]:.0e}"


def write_tiny(root, adapters: dict[str, tuple[int, int, str]]):
    """A tiny Llama directory and PEFT adapters (name -> (rank, alpha, targets)) under root: (model_dir, paths)."""
    from kubelora.cli.tiny import make_adapter, make_tiny_model

    model_dir = make_tiny_model(root / "model", arch="llama", seed=0)
    paths = {name: make_adapter(root / name, model_dir, rank=rank, alpha=alpha, targets=targets, seed=seed)
             for seed, (name, (rank, alpha, targets)) in enumerate(adapters.items(), start=1)}
    return model_dir, paths


def count_calls(monkeypatch, module, name: str) -> list:
    """Wrap module.name so that every call appends to the returned list (which a test may clear)."""
    calls: list = []
    op = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args, **kwargs: calls.append(1) or op(*args, **kwargs))
    return calls


def run_tiny(tiny, prompts, params, batch, inspect=None, **engine_args):
    """Generate on CPU in float32 with every adapter of `tiny` (write_tiny's) loaded: (results, inspect(llm))."""
    from kubelora.engine import LLM

    model_dir, adapters = tiny
    llm = LLM(model_dir, device="cpu", dtype="float32", **engine_args)
    try:
        for name, path in adapters.items():
            llm.load_adapter(name, path)
        results = llm.generate(prompts, params, adapters=batch)
        return results, (inspect(llm) if inspect is not None else None)
    finally:
        llm.close()


def decode_step(slots: list[int], tables: dict, staged=None):
    """A decode Step (engine/step/inputs.py) of one token per slot, each at position 0 of block 0."""
    import numpy as np

    from kubelora.engine.step.inputs import Step

    num = len(slots)
    return Step(token_ids=np.ones(num, dtype=np.int64), query_lens=[1] * num, start_pos=[0] * num,
                block_tables=[(0,)] * num, seq_slots=list(slots), slot_tables=tables, logits_rows=list(range(num)),
                staged=staged)


def decode_inputs(device, staged_kinds: tuple[str, ...] = ()):
    """Decode step inputs of up to 32 sequences with one qkv kind of three slices."""
    import torch

    from kubelora.engine.step.inputs import StepInputs

    return StepInputs(max_tokens=32, max_seqs=32, max_blocks=2, block_size=16, pad_block=5, kind_slices={"qkv": 3},
                      device=torch.device(device), staged_kinds=staged_kinds)
