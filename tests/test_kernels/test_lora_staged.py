"""The expand of a staged shrink (kernels/lora_triton.py: add_lora_staged_triton): each token's shrink rows read
from its own output row past the base columns, where a matmul over [W; staged A rows] put them; against float64
and against the expand's reference, on the step layouts of eager calls and of CUDA graphs (engine/step/inputs.py)."""

from __future__ import annotations

import pytest
import torch

from kubelora.engine.adapters.staging import StagedStep
from kubelora.engine.step.shape import decode_shape
from kubelora.kernels.lora import prepare_lora_proj
from lora_problems import build_problem, check_y, decode_inputs, decode_step

ODD_RANKS = [[3, 3, 0], [12, 12, 12], [24, 5, 24], [1, 0, 17]]
CASES = [
    (13, ODD_RANKS, [24, 8, 8], 40, "uniform", 0.25),
    (20, ODD_RANKS, [40, 12, 12], 72, "distinct", 0.0),
    (6, [[16]] * 6, [50], 24, "distinct", 0.0),
    (40, [[8, 8, 8]] * 2, [24, 8, 8], 40, "segments", 0.1),  # 20 tokens of one adapter: two tiles
]


def staged_output(p, gap: int = 5) -> tuple[torch.Tensor, list[list[int]], int]:
    """[y0 | shrink rows]: each adapter's slices' rows laid end to end from row `gap` on (staging order), as
    x @ [W; A_staged]^T leaves them; returns (y, t_col, base width)."""
    width = p.y0.shape[1]
    t_col, rows = [], gap
    for ranks in p.ranks:
        t_col.append([])
        for rank in ranks:
            t_col[-1].append(rows if rank else 0)
            rows += rank
    staged = torch.zeros(rows + 3, p.x.shape[1], dtype=p.x.dtype, device=p.x.device)
    for a, ranks in enumerate(p.ranks):
        for s, rank in enumerate(ranks):
            first = p.row_start[a][s]
            staged[t_col[a][s] : t_col[a][s] + rank] = p.lora_a[s][first : first + rank]
    return torch.cat([p.y0, p.x @ staged.T], dim=1), t_col, width


def with_t_col(proj, t_col, device):
    return type(proj)(row_start=proj.row_start, rank=proj.rank, scale=proj.scale, max_rank=proj.max_rank,
                      t_col=torch.tensor(t_col, dtype=torch.int64, device=device))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}tok-{len(c[1])}ad-{c[4]}")
def test_staged_expand_matches_float64(triton_backend, device, case):
    num_tokens, ranks, widths, in_dim, dist, no_adapter = case
    p = build_problem(num_tokens, ranks, widths, in_dim, dist, torch.float32, seed=21, device=device,
                      no_adapter=no_adapter)
    y, t_col, width = staged_output(p)
    shrink = y[:, width:].clone()
    proj = with_t_col(p.proj, t_col, device)
    triton_backend.add_lora_staged_triton(y, width, p.lora_b, proj, p.step)
    check_y(p, y[:, :width])
    assert torch.equal(y[:, width:], shrink)  # the shrink columns are read, never written

    from kubelora.kernels.lora_expand import lora_expand_staged_torch

    ref, _, _ = staged_output(p)
    active = [s for s, r in enumerate(proj.max_rank) if r > 0]
    offsets = [sum(widths[:s]) for s in range(len(widths))]
    lora_expand_staged_torch(ref, width, [p.lora_b[s] for s in active], proj, p.step, active,
                             [offsets[s] for s in active])
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


def test_staged_expand_on_the_graph_layout(triton_backend, device):
    """Decode step inputs with a staged kind: t_col filled per slot, read through the graph's LoRAProj; padded rows
    and the rank-0 pad slot's empty tiles leave y alone."""
    ranks = [[8, 0, 8], [20, 20, 20], [4, 4, 0]]
    p = build_problem(7, ranks, [64, 32, 32], 64, "uniform", torch.float32, seed=22, device=device)
    slots = [0, -1, 1, 2, 1, -1, 0]
    p.slots = slots
    bucket = 8
    y_real, t_col, width = staged_output(p)
    inputs = decode_inputs(device, staged_kinds=("qkv",))
    decode = decode_step(slots, {"qkv": (p.row_start, ranks, p.scale)},
                         StagedStep(rows={"qkv": 96}, t_col={"qkv": t_col}))
    shape = decode_shape(bucket, slots, decode.slot_tables, decode.staged.rows)
    assert shape.lora.stage == (("qkv", 96),)
    extent = inputs.static_extent(shape)
    inputs.fill(decode, extent)
    lora = inputs.context(extent, None).lora
    proj = lora.proj["qkv"]
    assert proj.t_col[:3].tolist() == t_col and not proj.t_col[3:].any()
    y = torch.cat([y_real, torch.randn(bucket - 7, y_real.shape[1], device=device)])
    padded = y[7:].clone()
    from kubelora.kernels.lora import prepare_lora_step

    p.step = prepare_lora_step(slots, len(ranks), device)
    triton_backend.add_lora_staged_triton(y, width, p.lora_b, proj, lora.step)
    check_y(p, y[:7, :width])
    assert torch.equal(y[7:], padded)


def test_unstaged_key_is_the_old_graph():
    assert decode_shape(1, [0], {"qkv": ([[0, 0, 0]], [[8, 8, 8]], [[1.0] * 3])}).lora.stage == ()
    proj = prepare_lora_proj([[0, 0, 0]], [[8, 8, 8]], [[1.0] * 3], "cpu")
    assert proj.t_col is None
