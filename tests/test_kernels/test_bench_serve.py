"""The serving benchmark (`kubelora bench serve`) at toy size on CPU; the Triton backend runs interpreted."""

from __future__ import annotations

from pathlib import Path


def test_bench_serve_runs_every_scenario_on_cpu(tmp_path: Path, triton_backend, device):
    """The serving benchmark's code path at toy size (CPU in CI): base, adapters on both backends, the markdown."""
    from kubelora.bench import serve as bench_serve

    out = tmp_path / "serving.md"
    argv = ["--device", device, "--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads",
            "2", "--intermediate-size", "128", "--vocab-size", "400", "--rank", "4", "--adapters", "1", "3",
            "--num-requests", "5", "--prompt-len", "6", "--output-len", "3", "--workdir", str(tmp_path / "w"),
            "--write", str(out)]
    assert bench_serve.main(argv) == 0
    text = out.read_text()
    for label in ("base model", "1 adapters", "3 adapters", "base model, torch backend", "3 adapters, torch backend"):
        assert f"| {label} | 5 | 15 |" in text
    if device == "cpu":  # float32: the two backends agree on every request
        assert "3 adapters: triton and torch backends agree on the first generated token of 5 of 5 requests and " \
               "on 3.0 leading tokens" in text
    adapters = sorted(p.name for p in (tmp_path / "w").iterdir() if p.name.startswith("adapter-"))
    assert adapters == ["adapter-0", "adapter-1", "adapter-2"]
