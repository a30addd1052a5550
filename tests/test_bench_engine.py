"""The engine benchmark (`kubelora bench engine`) on CPU at the smoke preset: every scenario, HTTP included.

The H200 run is its own command (bench/engine.sh); here the point is that every code path runs and the report
has every row and every target.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from kubelora.cli.tiny import ATTENTION_TARGETS, make_adapter, make_tiny_model

ROWS = ("base, batch 1", "base, batch 4", "batch 4, 2 adapters r16", "batch 4, 4 adapters r16",
        "batch 4, 2 adapters, ranks 8/24", "batch 4, 2 adapters, rank 16 (their mean)",
        "batch 4, 2 adapters r16 all-linear", "batch 4, 12 adapters registered (10 preloaded), none used",
        "4 requests over 2 adapters, device budget for 1", "4 requests over 2 adapters, EngineConfig's adapter defaults",
        "prefill 2 x 16, base", "prefill 2 x 16, 2 adapters r16", "compiled transformers, batch 1",
        "compiled transformers, batch 4", "HTTP, 4 streams over 2 adapters",
        "batch 4, 2 of them structured (JSON schema, regex)")
TARGETS = ("base, batch 1: ms/step against the bytes floor", "base, batch 4: share of the bytes floor bound",
           "batch 1: speed-up over compiled transformers", "batch 4: speed-up over compiled transformers",
           "mixed ranks against a uniform batch", "adapters registered but unused",
           "prefill: model FLOP/s against the measured matmul rate", "prefill with 2 adapters",
           "HTTP tokens/s against the offline engine", "first request after /ready",
           "budget for 1: TTFT p99", "budget for 1: tokens/s", "defaults: 4 requests over 2 adapters in one batch",
           "2 of 4 requests structured: tokens/s against none")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("bench-engine") / "model")


def test_bench_engine_runs_every_scenario_on_cpu(tiny_model: Path, tmp_path: Path):
    from kubelora.bench import engine

    report, raw = tmp_path / "report.md", tmp_path / "raw.json"
    argv = ["--preset", "smoke", "--model-dir", str(tiny_model), "--workdir", str(tmp_path / "work"),
            "--profile", "--write", str(report), "--json", str(raw)]
    assert engine.main(argv) == 0
    text, data = report.read_text(), json.loads(raw.read_text())
    assert data["errors"] == {}
    for label in ROWS:
        assert f"| {label} |" in text, label
    assert {"base-b1", "base-b4", "lora-a2", "lora-a4", "mixed", "mean-rank", "all-linear", "unused", "budget",
            "defaults", "prefill-base", "prefill-lora", "hf-b1", "hf-b4", "http", "structured"} <= set(data["rows"])
    for row in data["rows"].values():
        assert len(row["runs"]) == 1 and all(r["num_tokens"] > 0 for r in row["runs"]), row["key"]
    targets = text.split("## Targets")[1]
    for name in TARGETS:
        assert name in targets, name
    assert data["rows"]["http"]["runs"][0]["num_tokens"] == 4 * 4
    http = data["rows"]["http"]  # its extra fields are flattened into the row
    # Each single request's time inside the server, from the difference of two /metrics scrapes around it: its
    # queue and prefill seconds are that request's own (positive, and within what its client waited).
    assert len(http["steady_split_s"]) == len(http["steady_ttft_probes_s"]) == 9
    for (queued, prefill), ttft in zip([http["cold_split_s"]] + http["steady_split_s"],
                                       [http["cold_ttft_starts_s"][0]] + http["steady_ttft_probes_s"]):
        assert queued >= 0 and 0 < prefill and queued + prefill <= ttft
    # The first request is timed on each fresh server; the target compares the medians over the starts.
    assert len(http["cold_ttft_starts_s"]) == len(http["steady_ttft_starts_s"]) == len(http["ready_starts_s"]) == 2
    assert http["cold_ttft_s"] == statistics.median(http["cold_ttft_starts_s"])
    assert "Inside the server" in text
    assert data["rows"]["base-b4"]["profile"]["num_steps"] >= 1
    assert "## Profile" in text and "## Bytes floor" in text and "## Prefill" in text
    assert data["engines"]["base"]["startup_phases_s"]["weights"] > 0 and "(weights " in text  # phases timed


def test_bench_adapters_have_peft_keys_and_shapes(tiny_model: Path, tmp_path: Path):
    from safetensors import safe_open

    from kubelora.bench.engine_assets import AdapterSpec, shape_of, write_adapters

    peft = make_adapter(tmp_path / "peft", tiny_model, rank=4, targets=",".join(ATTENTION_TARGETS))
    [ours] = write_adapters(tmp_path, [AdapterSpec("ours", 4)], shape_of(tiny_model), tiny_model, "cpu").values()
    with safe_open(str(peft / "adapter_model.safetensors"), "pt") as a, \
            safe_open(str(ours / "adapter_model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(a.get_slice(k).get_shape() == b.get_slice(k).get_shape() for k in a.keys())
    theirs, mine = (json.loads((d / "adapter_config.json").read_text()) for d in (peft, ours))
    for key in ("peft_type", "r", "bias", "use_rslora", "use_dora", "fan_in_fan_out"):
        assert theirs[key] == mine[key], key
    assert sorted(theirs["target_modules"]) == sorted(mine["target_modules"])


def test_bench_model_loads_in_transformers_and_the_engine(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    from kubelora.bench.engine_assets import SHAPES, write_model
    from kubelora.engine import LLM, SamplingParams

    model_dir = write_model(tmp_path / "model", SHAPES["tiny"], "cpu")
    _, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    llm = LLM(model_dir, device="cpu", max_model_len=64)
    try:
        [result] = llm.generate([[11, 12, 13]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finally:
        llm.close()
    assert len(result.token_ids) == 3 and result.text  # every id decodes to text (added tokens past the BPE)


def test_bench_engine_run_resumes_from_its_checkpoint(tiny_model: Path, tmp_path: Path, monkeypatch, capsys):
    """A run over two processes: the first stops after the base engine (exit 3, the rest named unfinished), the
    second keeps what the first measured, runs only the stages left and reports one run of two processes; other
    settings or another machine are refused."""
    from kubelora.bench import engine, engine_checkpoint, engine_rows

    checkpoint, raw = tmp_path / "run.ckpt", tmp_path / "raw.json"
    argv = ["--preset", "smoke", "--scenarios", "base,budget", "--model-dir", str(tiny_model), "--workdir",
            str(tmp_path / "work"), "--checkpoint", str(checkpoint), "--json", str(raw), "--stop-after", "600"]
    with monkeypatch.context() as patch:
        patch.setattr(engine_checkpoint.Checkpoint, "is_out_of_time", lambda self: "base engine" in self.done)
        assert engine.main(argv) == engine_checkpoint.UNFINISHED_EXIT
    first = json.loads(raw.read_text())
    assert first["unfinished"] == ["adapter engine", "budget engine"]  # budget compares with the adapter engine
    assert "budget" not in first["rows"] and "base-b4" in first["rows"]
    assert "- unfinished: adapter engine, budget engine" in capsys.readouterr().out

    ran = []
    for name in ("run_base_engine", "run_lora_engine", "run_budget_engine"):
        original = getattr(engine_rows.EngineRows, name)
        monkeypatch.setattr(engine_rows.EngineRows, name,
                            lambda self, original=original, name=name: (ran.append(name), original(self))[1])
    assert engine.main(argv) == 0
    second = json.loads(raw.read_text())
    assert ran == ["run_lora_engine", "run_budget_engine"]
    assert second["rows"]["base-b4"] == first["rows"]["base-b4"] and "budget" in second["rows"]
    assert second["unfinished"] == [] and second["errors"] == {} and len(second["processes"]) == 2
    assert second["total_s"] == sum(p["seconds"] for p in second["processes"])
    assert "- processes: 2 on 1 machine (`--checkpoint`)" in capsys.readouterr().out

    assert engine.main([*argv, "--repeats", "2"]) == 2
    assert "other settings (num_repeats)" in capsys.readouterr().out
    monkeypatch.setattr(engine_checkpoint, "machine_id", lambda: "elsewhere/0")
    assert engine.main(argv) == 2
    assert "holds a run of machine" in capsys.readouterr().out


def test_bench_long_context_decode_against_the_floor_on_cpu(tiny_model: Path, tmp_path: Path):
    """`--preset long-context` with its contexts scaled down to a few KV blocks: one engine per context, each
    sized for the whole batch at it, a base row and an adapter row per context, their floors (weights + each
    sequence's KV + the adapters' bytes) and the >= 70% target judged on each."""
    from kubelora.bench import engine
    from kubelora.bench.engine_assets import AdapterSpec, shape_of
    from kubelora.bench.engine_device import kv_bytes, weight_bytes
    from kubelora.bench.engine_targets import MIN_LONG_CONTEXT_FLOOR_SHARE, _verdict

    report, raw = tmp_path / "report.md", tmp_path / "raw.json"
    argv = ["--preset", "long-context", "--device", "cpu", "--shape", "tiny", "--model-dir", str(tiny_model),
            "--workdir", str(tmp_path / "work"), "--long-contexts", "48,120", "--long-batch", "4",
            "--long-adapters", "2", "--output-len", "6", "--warmup-tokens", "2", "--repeats", "2", "--copy-mib", "4",
            "--matmul-size", "64", "--max-num-batched-tokens", "64", "--write", str(report), "--json", str(raw)]
    assert engine.main(argv) == 0
    text, data = report.read_text(), json.loads(raw.read_text())
    assert data["errors"] == {} and set(data["rows"]) == {"long-48-a0", "long-48-a2", "long-120-a0", "long-120-a2"}
    assert [name for name, _ in data["stages"]][-2:] == ["long-context engine, 48 tokens",
                                                         "long-context engine, 120 tokens"]
    # The engine of the longer context: 126 tokens a sequence -> 128 (8 blocks), plus two spare blocks each.
    options = data["engines"]["long-context 120"]["options"]
    assert options.items() >= {"max_model_len": 128, "num_kv_blocks": 4 * 10, "max_num_seqs": 4}.items()
    shape = shape_of(tiny_model)
    adapter = AdapterSpec("r", 16).num_bytes(shape)
    table = text.split("## Decode at long contexts")[1].split("\n## ")[0]
    targets = {t["name"]: t for t in data["targets"]}
    for context in (48, 120):  # a whole number of KV blocks (as 8k and 32k), and not
        for n in (0, 2):
            row, floor = data["rows"][f"long-{context}-a{n}"], data["long_context_floors"][f"{context}x{n}"]
            assert len(row["runs"]) == 2 and all(r["max_batch"] == 4 for r in row["runs"])  # one batch
            # Prefilled once: the warm-up's prompts take chunks of 64 tokens, a timed repeat finds them in the prefix
            # cache (all but the last block) and takes one step for its first tokens, then one per decode step.
            assert row["warmup"]["num_steps"] > 2 * context / 64 and all(r["num_steps"] == 6 for r in row["runs"])
            assert floor["step_bytes"] == weight_bytes(shape) + kv_bytes(shape, 4, context, 6) + n * adapter
            steps = sorted(r["decode_ms"] for r in row["runs"])
            share = floor["ms"] / statistics.median(steps)
            adapters = f"{n} adapters r16" if n else "base"
            assert f"| {context} | {n} | 4 | " in table and f"| {share:.0%} |" in table
            target = targets[f"batch 4 at {context} tokens of context, {adapters}: share of the bytes floor bound"]
            assert target["required"] == ">= 70%"
            assert target["verdict"] == _verdict(share, MIN_LONG_CONTEXT_FLOOR_SHARE, False,
                                                 (floor["ms"] / steps[-1], floor["ms"] / steps[0]))
    assert "missed by" in targets["batch 4 at 120 tokens of context, base: share of the bytes floor bound"]["verdict"]


@pytest.mark.parametrize(("share", "verdict"), [(0.8, "met (14% margin)"), (0.35, "missed by 50%")])
def test_long_context_target_says_met_or_missed_by_how_much(share: float, verdict: str):
    """A long-context row at a given share of its bytes floor: met above 70%, else missed by the shortfall."""
    from kubelora.bench.engine_assets import SHAPES
    from kubelora.bench.engine_long_context import floors
    from kubelora.bench.engine_offline import Row, RunStats
    from kubelora.bench.engine_plan import EngineBenchConfig
    from kubelora.bench.engine_report import BenchResult, render_markdown

    config = EngineBenchConfig(device="cpu", shape=SHAPES["8b"], scenarios=("long-context",), long_contexts=(8192,))
    result = BenchResult(config, {}, shape=SHAPES["8b"], copy_bytes_per_s=4e12)
    result.rows["long-8192-a0"] = Row("long-8192-a0", "base at 8k", [RunStats(1.0, 16, 10.0, 128, [], max_batch=16)])
    floor = floors(result)[(8192, 0)]
    result.rows["long-8192-a0"].runs[0].decode_ms = floor.ms / share
    # 8B weights (the embedding table only indexed) and 16 sequences' 128 KiB of KV a token at 8192..8320 tokens.
    assert floor.step_bytes == pytest.approx(2 * (8.03e9 - 128256 * 4096) + 16 * 8256 * 128 * 1024, rel=1e-3)
    line = next(line for line in render_markdown(result).splitlines()
                if line.startswith("| batch 16 at 8192 tokens of context, base: share of the bytes floor bound"))
    assert line.endswith(f"| >= 70% | {verdict} |")
