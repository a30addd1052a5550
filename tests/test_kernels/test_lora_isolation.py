"""One slot's pool rows never reach another slot's tokens, whatever they hold: with one adapter's A and B rows, and
the pool rows no adapter owns, set to NaN or infinity, every other token's output is bit for bit the output of the
clean pools. The torch reference and the Triton launches (shrink and expand in each launch shape, the staged
expand, the fused q/k/v expand with rotary) mask by selecting rows and lanes, never by multiplying by zero."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from kubelora.kernels.lora import add_lora
from kubelora.kernels.lora_config import step_config
from lora_problems import build_problem

BAD = 1  # the adapter whose rows are poisoned
CASES = [  # (num_tokens, ranks per adapter and slice, slice widths, in_dim, distribution, share without adapter)
    (13, [[3, 3, 0], [12, 12, 12], [24, 5, 24], [1, 0, 17]], [24, 8, 8], 40, "uniform", 0.25),
    (70, [[16]] * 4, [50], 24, "segments", 0.2),
]
# Launch shapes (changes to the tile height's default config); None: the step's own choice through add_lora.
LAUNCHES = {"auto": None, "split": {}, "slice": {"is_per_slice": True}, "gemv": {"gemv_rows": 8},
            "stack": {"stack_tokens": 8}, "loaded-y": {"is_red_y": False}}


def build(case, device):
    num_tokens, ranks, widths, in_dim, dist, no_adapter = case
    return build_problem(num_tokens, ranks, widths, in_dim, dist, torch.float32, seed=5, device=device,
                         no_adapter=no_adapter)


def owned_rows(p, s: int) -> set[int]:
    return {r for a, ranks in enumerate(p.ranks) for r in range(p.row_start[a][s], p.row_start[a][s] + ranks[s])}


def poison(p, value: float) -> None:
    """Adapter BAD's rows and the unowned rows of every slice's A and B pools set to `value`."""
    for s, (a_pool, b_pool) in enumerate(zip(p.lora_a, p.lora_b)):
        owned = owned_rows(p, s)
        bad = set(range(p.row_start[BAD][s], p.row_start[BAD][s] + p.ranks[BAD][s]))
        rows = sorted(bad | (set(range(a_pool.shape[0])) - owned))
        a_pool[rows] = value
        b_pool[rows] = value


def victims(p) -> torch.Tensor:
    """[num_tokens] bool: tokens of another adapter or of none."""
    return torch.tensor([slot != BAD for slot in p.slots], device=p.x.device)


def run(p, backend: str, launch: str, triton_backend) -> torch.Tensor:
    y = p.y0.clone()
    if backend == "torch" or LAUNCHES[launch] is None:
        add_lora(y, p.x, p.lora_a, p.lora_b, p.proj, p.step, backend=backend)
    else:
        triton_backend.add_lora_triton(y, p.x, p.lora_a, p.lora_b, p.proj, p.step,
                                       step_config(p.step, **LAUNCHES[launch]))
    return y


def assert_victims_unchanged(p, clean: torch.Tensor, got: torch.Tensor) -> None:
    keep = victims(p)
    assert torch.isfinite(got[keep]).all(), "a poisoned slot reached another slot's tokens"
    assert torch.equal(got[keep], clean[keep])


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}tok-{len(c[1])}ad-{c[4]}")
def test_torch_reference_isolates_slots(device, case, value):
    p = build(case, device)
    clean = run(p, "torch", "auto", None)
    poison(p, value)
    assert_victims_unchanged(p, clean, run(p, "torch", "auto", None))


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}tok-{len(c[1])}ad-{c[4]}")
def test_triton_launches_isolate_slots(triton_backend, device, case, launch):
    p = build(case, device)
    clean = run(p, "triton", launch, triton_backend)
    poison(p, math.nan)
    assert_victims_unchanged(p, clean, run(p, "triton", launch, triton_backend))


def test_staged_expand_isolates_slots(triton_backend, device):
    from test_lora_staged import staged_output, with_t_col

    p = build(CASES[0], device)
    y_clean, t_col, width = staged_output(p)
    proj = with_t_col(p.proj, t_col, device)
    triton_backend.add_lora_staged_triton(y_clean, width, p.lora_b, proj, p.step)
    poison(p, math.nan)
    y, _, _ = staged_output(p)  # the matmul's shrink columns against the poisoned A rows too
    triton_backend.add_lora_staged_triton(y, width, p.lora_b, proj, p.step)
    assert_victims_unchanged(p, y_clean[:, :width], y[:, :width])


def test_expand_rotary_isolates_slots(triton_backend, device):
    from test_lora_rotary import CASES as ROTARY_CASES, build as build_rotary, cloned

    mod = sys.modules["kubelora.kernels.lora_rotary"]
    case = ROTARY_CASES[0]  # two adapters: 0 on prompts 0 and 2, 1 on prompt 1
    clean = build_rotary(case, device)
    bad = cloned(clean)
    ranks, rows = case[3][1], clean["proj"].row_start[1].tolist()
    for s, (a_pool, b_pool) in enumerate(zip(bad["lora_a"], bad["lora_b"])):
        a_pool[rows[s] : rows[s] + ranks[s]] = math.nan
        b_pool[rows[s] : rows[s] + ranks[s]] = math.nan
    for p in (clean, bad):
        mod.add_lora_rotary_kv_cache_(**p)
    keep = clean["step"].token_slots != 1
    assert torch.equal(bad["qkv"][keep], clean["qkv"][keep])
    cache_slots = clean["slot_mapping"][keep & (clean["slot_mapping"] >= 0)]
    for name in ("key_cache", "value_cache"):
        flat_clean = clean[name].view(-1, *clean[name].shape[2:])[cache_slots]
        flat_bad = bad[name].view(-1, *bad[name].shape[2:])[cache_slots]
        assert torch.isfinite(flat_bad).all() and torch.equal(flat_bad, flat_clean), name
