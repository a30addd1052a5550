"""The benchmark's PyTorch baselines compute the op they are compared with; its report logic; its variant runs (GPU)."""

from __future__ import annotations

import pytest
import torch

from kubelora.bench.baselines import build_sets, gather_bmm, per_adapter_loop, torch_reference
from kubelora.bench.kernels import default_shapes, floor_bytes
from kubelora.bench.report import Row, format_table, mixed_rank_lines
from kubelora.kernels.lora import prepare_lora_step


@pytest.mark.parametrize("baseline", [gather_bmm, per_adapter_loop])
def test_baselines_match_reference(baseline):
    slots = [2, 0, 1, 1, 0, 2, 2, 1]
    step = prepare_lora_step(slots, 3, "cpu")
    sets = build_sets(slots, [3, 8, 5], [16, 8, 8], 24, 2, step, torch.float32, device="cpu")
    st = sets[1]
    y0 = st.y.clone()
    torch_reference(st)
    expected, st.y = st.y, y0.clone()
    baseline(st)
    torch.testing.assert_close(st.y, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(st.y, y0)


def test_reference_floors_of_the_issue():
    floors = {s.name: floor_bytes(s, 4096, [4096] * 3, 2) / 4270e3 for s in default_shapes()}
    assert floors["16 x 8 x 16"] == pytest.approx(1.7, abs=0.05)
    assert floors["64 x 32 x 64"] == pytest.approx(24.4, abs=0.1)
    assert floors["prefill 4 x 512, 4 x 16"] == pytest.approx(28.2, abs=0.1)


def test_report_targets():
    fast = Row("64 x 32 x 64", 100, 24.0, 1e-3, 16, {"ours": 40.0, "gather+bmm": 150.0, "loop": 300.0})
    slow = Row("16 x 8 x 16", 100, 1.7, 1e-3, 16, {"ours": 12.0, "gather+bmm": 30.0})
    assert fast.targets() == [">=50% BW met", ">=3x torch met"]
    assert slow.targets() == ["<=10us MISSED", ">=3x torch MISSED"]
    assert "| 64 x 32 x 64 | 16 | 24.0 | 40.0 |" in format_table([fast, slow])
    mixed = Row("64 x 32 x 8..64 mixed", 100, 14.0, 1e-3, 16, {"ours": 25.0})
    uniform = Row("64 x 32 x 36", 100, 14.0, 1e-3, 16, {"ours": 20.0})
    assert "ratio 1.25 (target <= 1.2: MISSED)" in mixed_rank_lines([mixed, uniform])[0]


@pytest.mark.gpu
def test_variant_comparison_runs(triton_backend, device, monkeypatch):
    """The bench's --compare and --tune code paths at toy sizes with a stand-in timer (part of bench/h200.sh: under
    Triton's CPU interpreter it takes about 90 s, so the CPU suite leaves it out)."""
    from kubelora.bench import kernels as bench_kernels, variants as bench_variants

    def fake_timer(fn, sets, **kwargs):
        for st in sets:
            fn(st)
        return 1.0

    for name, value in (("DEVICE", device), ("HIDDEN", 40), ("WIDTHS", [24, 8, 8]), ("L2_BYTES", 1)):
        monkeypatch.setattr(bench_kernels, name, value)
    monkeypatch.setattr(bench_variants, "time_graph", fake_timer)
    shape = bench_kernels.decode_shape(20, 3, [8, 3, 17])
    lines = bench_variants.compare_paths([shape], torch.float32, with_pdl=False)
    assert "BAD" not in lines[0] and "auto 1.0" in lines[0] and "slice s1 1.0" in lines[0] and "+pdl" not in lines[0]
    lines = bench_variants.compare_paths([shape], torch.float32, with_pdl=True)  # PDL itself off the GPU
    assert "BAD" not in lines[0] and "slice pdl t1024 1.0" in lines[0] and "pdl s1 split4 1.0" in lines[0]
    lines = bench_variants.compare_paths([shape], torch.float32, with_pdl=True, labels=["auto", "gemv2"])
    assert lines[0].endswith("auto 1.0, gemv2 1.0")
    with pytest.raises(SystemExit, match="unknown variants: nope"):
        bench_variants.compare_paths([shape], torch.float32, with_pdl=False, labels=["auto", "nope"])
    lines = bench_variants.tune([shape], torch.float32)
    assert "auto (" in lines[0] and "tiles=16,32 1.0" in lines[0] and "n128 w4 1.0" in lines[0]
    monkeypatch.setattr(bench_kernels, "time_graph", fake_timer)
    row = bench_kernels.bench_shape(shape, 4e12, torch.float32, with_baselines=True)
    assert row.error < 1e-4 and set(row.times) == {"ours", "gather+bmm", "loop", "torch ref"}
