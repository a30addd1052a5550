"""FP8 base checkpoints as published, with float adapters on top.

The checkpoints are written by the library that defines their format: compressed-tensors quantizes a tiny Llama with
its presets (FP8_DYNAMIC: per-channel weights, dynamic per-token inputs; FP8: static per-tensor weights and inputs;
FP8_BLOCK: 128x128 weight blocks, dynamic per-token-group inputs) and saves it with its ModelCompressor. It has no
calibration observers of its own (llm-compressor's, which does not install beside our torch and transformers), so
the scales are its `calculate_qparams` over each weight's min/max (and, for static inputs, over the inputs of one
calibration prompt). On CPU the engine's greedy tokens and logits equal transformers' dequantizing load of the same
checkpoint with PEFT (weights dequantized, inputs not quantized), in one mixed batch. transformers writes
`quant_method: fp8` files only on a GPU: on CPU its reader is checked against transformers' own FP8 quantize and
dequantize ops, and the file it writes is served in the GPU suite (marker gpu).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kubelora.engine import LLM, SamplingParams

TOL = 1e-4  # float32 max abs logit difference
NUM_DECODE = 8
PRESETS = {"FP8_DYNAMIC": "fp8-channel-dynamic-token", "FP8": "fp8-tensor-static-tensor",
           "FP8_BLOCK": "fp8-block128x128-dynamic-group"}
# name -> (rank, alpha, targets): adapters over the quantized projections (qkv, whose k and v end mid-block for
# FP8_BLOCK; gate_up, whose blocks stack whole)
ADAPTERS = {"r4-qv": (4, 8, "q_proj,v_proj"), "r8-all": (8, 16, "all-linear"),
            "r16-mlp": (16, 8, "gate_proj,up_proj,down_proj")}
BATCH = [None, "r4-qv", "r8-all", "r16-mlp", "r4-qv", None]
# 128-wide layers: one 128x128 block across a projection's input; k and v (64 rows each) are partial blocks
SIZES = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)


def _weight_range(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of a weight over each of its scale's regions (what a min/max observer records)."""
    from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant

    if args.strategy == "tensor":
        return weight.amin(), weight.amax()
    if args.strategy == "channel":
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    rows, cols = args.block_structure
    blocks = maybe_pad_tensor_for_block_quant(weight, (rows, cols)).unflatten(0, (-1, rows)).unflatten(2, (-1, cols))
    return blocks.amin((1, 3)), blocks.amax((1, 3))


def write_compressed_tensors(model_dir: Path, out: Path, preset: str, calibration: list[int]) -> Path:
    """The float checkpoint in model_dir quantized by compressed-tensors with `preset` (lm_head ignored), saved in
    its format with the tokenizer beside it."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)
    modules = {name: m for name, m in model.named_modules() if hasattr(m, "weight_scale")}
    input_max: dict[str, float] = {}

    def observe(name):
        def hook(module, args):
            input_max[name] = max(input_max.get(name, 0.0), float(args[0].abs().max()))
        return hook

    hooks = [m.register_forward_pre_hook(observe(name)) for name, m in modules.items()]
    with torch.no_grad():
        model(torch.tensor([calibration]))
        for hook in hooks:
            hook.remove()
        for name, module in modules.items():
            args = module.quantization_scheme.weights
            scale, _ = calculate_qparams(*_weight_range(module.weight, args), args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "input_scale"):  # static inputs
                bound = torch.tensor(input_max[name])
                scale, _ = calculate_qparams(-bound, bound, module.quantization_scheme.input_activations)
                module.input_scale.copy_(scale.reshape(module.input_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for path in model_dir.glob("tokenizer*"):
        shutil.copy(path, out / path.name)
    return out


@pytest.fixture(scope="module")
def fp8_bases(tmp_path_factory, prompt_ids):
    """(float Material, preset -> FP8 model dir), built on first use."""
    from kubelora.cli.tiny import make_adapter, make_tiny_model

    from .conftest import Material

    root = tmp_path_factory.mktemp("fp8")
    model_dir = make_tiny_model(root / "model", arch="llama", seed=0, **SIZES)
    adapters = {name: make_adapter(root / name, model_dir, rank=rank, alpha=alpha, targets=targets, seed=seed)
                for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items(), start=1)}
    material = Material("llama", model_dir, adapters)
    built: dict[str, Path] = {}

    def build(preset: str) -> Path:
        if preset not in built:
            built[preset] = write_compressed_tensors(model_dir, root / preset.lower(), preset, prompt_ids(0, 16))
        return built[preset]

    return material, build


def dequantized_reference(model_dir: Path, adapters: dict[str, Path]):
    """transformers' dequantizing load of a compressed-tensors checkpoint (float weights, inputs not quantized)
    with every adapter through PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                quantization_config=CompressedTensorsConfig(run_compressed=False))
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


def run_batch(model_dir: Path, material, prompts: list[list[int]], **options) -> tuple[str, list]:
    """(the base's reported format, results) of BATCH over the engine on model_dir with every test adapter."""
    llm = LLM(model_dir, max_loras=3, max_lora_rank=16, **options)
    try:
        for name, path in material.adapters.items():
            llm.load_adapter(name, path)
        params = SamplingParams(max_tokens=NUM_DECODE, temperature=0.0, ignore_eos=True, return_logits=True)
        return llm.engine.base_weights.format, llm.generate(prompts, params, adapters=BATCH)
    finally:
        llm.close()


def reference_logits_of(model_dir: Path, material, prompts, results, peft_reference) -> list[torch.Tensor]:
    """The dequantized reference's logits over each prompt and the tokens the engine generated after it."""
    reference = dequantized_reference(model_dir, material.adapters)
    _, reference_logits = peft_reference
    return [reference_logits(reference, name, prompt + result.token_ids[:-1])
            for name, prompt, result in zip(BATCH, prompts, results)]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_mixed_batch_matches_dequantized_transformers_peft(preset, fp8_bases, prompt_ids, peft_reference):
    material, build = fp8_bases
    prompts = [prompt_ids(i, 6 + 3 * i) for i in range(len(BATCH))]
    fmt, results = run_batch(build(preset), material, prompts)
    assert fmt == PRESETS[preset]
    expected = reference_logits_of(build(preset), material, prompts, results, peft_reference)
    for name, prompt, result, logits in zip(BATCH, prompts, results, expected):
        assert logits[len(prompt) - 1 :].argmax(-1).tolist() == result.token_ids, name
        assert (result.prompt_logits - logits[: len(prompt)]).abs().max() < TOL, name
        assert (result.logits - logits[len(prompt) - 1 :]).abs().max() < TOL, name


def test_weights_stay_fp8_and_are_counted_as_stored(fp8_bases):
    """Projections are FP8 values with their scales (a quarter of float32's bytes), the ignored lm_head stays float,
    and the reported bytes are those; the quantization changes the output (the test above is not a float base's)."""
    from kubelora.engine.model.quantized import Fp8Linear

    material, build = fp8_bases
    fp8, dense = LLM(build("FP8_DYNAMIC"), max_lora_rank=8), LLM(material.model_dir, max_lora_rank=8)
    try:
        weights = fp8.engine._runner.model.weights
        assert all(isinstance(w, Fp8Linear) and w.weight.dtype == torch.float8_e4m3fn
                   for layer in weights.layers for w in layer.weight.values())
        assert weights.lm_head.dtype == torch.float32
        projections = sum(w.weight.numel() for layer in weights.layers for w in layer.weight.values())
        saved = dense.engine.base_weights.bytes - fp8.engine.base_weights.bytes
        assert saved == 3 * projections - sum(w.scale.numel() * 4 for layer in weights.layers
                                                for w in layer.weight.values())
        params = SamplingParams(max_tokens=1, temperature=0.0, return_logits=True)
        a, b = (llm.generate([[1, 20, 30, 40]], params)[0].prompt_logits for llm in (fp8, dense))
        assert (a - b).abs().max() > 1e-2
    finally:
        fp8.close()
        dense.close()


def _quantization(config: dict):
    from kubelora.engine.model.config import quantization_from_hf

    return quantization_from_hf(SimpleNamespace(quantization_config=config))


def _compressed_tensors_config(preset: str, fmt: str, **changes) -> dict:
    """A compressed-tensors quantization_config as the library dumps it, for a preset scheme."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=["lm_head"], format=fmt).model_dump()
    return {**config, "quant_method": "compressed-tensors", **changes}


@pytest.mark.parametrize(("config", "named"), [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "quant_method 'gptq'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, "quant_method 'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
])
def test_other_formats_are_refused_naming_them(config, named):
    with pytest.raises(ValueError, match=f"{named}.*not served; served FP8 base checkpoints: compressed-tensors"):
        _quantization(config)


@pytest.mark.parametrize(("preset", "fmt", "changes", "named"), [
    ("W4A16", "pack-quantized", {}, "format 'pack-quantized'"),
    ("W8A8", "int-quantized", {}, "format 'int-quantized'"),
    ("NVFP4", "nvfp4-pack-quantized", {}, "format 'nvfp4-pack-quantized'"),
    ("FP8_DYNAMIC", "float-quantized", {"ignore": []}, r"ignore \(must list lm_head"),
    ("FP8_DYNAMIC", "float-quantized", {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
     "kv_cache_scheme"),
])
def test_other_compressed_tensors_schemes_are_refused_naming_them(preset, fmt, changes, named):
    with pytest.raises(ValueError, match=named):
        _quantization(_compressed_tensors_config(preset, fmt, **changes))


@pytest.mark.parametrize(("preset", "role", "changes", "named"), [
    ("FP8_DYNAMIC", "weights", {"strategy": "group", "group_size": 128}, r"weights.strategy.*'group'"),
    ("FP8_BLOCK", "input_activations", {"group_size": 64}, r"group_size \(a weight block's width"),
    ("FP8_DYNAMIC", "weights", {"num_bits": 4}, r"weights \(num_bits, type, symmetric\) \(4, 'float'"),
])
def test_fp8_schemes_other_than_served_are_refused(preset, role, changes, named):
    config = _compressed_tensors_config(preset, "float-quantized")
    config["config_groups"]["group_0"][role].update(changes)
    with pytest.raises(ValueError, match=named):
        _quantization(config)


def test_refused_at_start_up(fp8_bases, tmp_path):
    """The engine does not start on a format it cannot serve, and says which."""
    material, _ = fp8_bases
    model_dir = tmp_path / "model"
    shutil.copytree(material.model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = _compressed_tensors_config("W4A16", "pack-quantized")
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="format 'pack-quantized' is not served"):
        LLM(model_dir)


def test_fine_grained_fp8_reader_equals_transformers_dequantization(tmp_path):
    """quant_method fp8: transformers' own quantize op writes two modules' values and weight_scale_inv (128x128
    blocks); the engine's reader, stacking them as one projection, dequantizes to what transformers' dequantize op
    gives."""
    from safetensors.torch import save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    from kubelora.engine.model.config import quantization_from_hf
    from kubelora.engine.model.quantized import read_fp8_linear
    from kubelora.engine.model.weights import CheckpointReader
    from kubelora.kernels.fp8 import dequantize

    hf_config = FineGrainedFP8Config(weight_block_size=[128, 128])
    quantizer = SimpleNamespace(quantization_config=hf_config)
    generator = torch.Generator().manual_seed(0)
    names = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    tensors = {}
    for i, name in enumerate(names):
        weight = torch.randn(256, 384, generator=generator) * (0.1 + i)
        tensors.update(Fp8Quantize(quantizer)._quantize_one(f"{name}.weight", weight))
    save_file(tensors, tmp_path / "model.safetensors")
    scheme = quantization_from_hf(SimpleNamespace(quantization_config=hf_config.to_dict()))
    linear = read_fp8_linear(CheckpointReader(tmp_path), names, scheme)
    expected = torch.cat([Fp8Dequantize(quantizer)._dequantize_one(tensors[f"{n}.weight"],
                                                                   tensors[f"{n}.weight_scale_inv"], torch.float32)
                          for n in names])
    assert torch.equal(dequantize(linear.weight, linear.scale, linear.block, torch.float32), expected)
    assert linear.scale.shape == (4, 3) and linear.block == (128, 128)  # the grids stacked as stored


def test_dora_over_an_fp8_base_is_refused_naming_its_format(fp8_bases, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from kubelora.engine.errors import InvalidAdapter

    material, build = fp8_bases
    base = AutoModelForCausalLM.from_pretrained(material.model_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)).save_pretrained(tmp_path / "dora")
    llm = LLM(build("FP8_DYNAMIC"), max_lora_rank=8)
    try:
        with pytest.raises(InvalidAdapter, match="use_dora.*fp8-channel-dynamic-token"):
            llm.load_adapter("dora", tmp_path / "dora")
        llm.load_adapter("plain", material.adapters["r4-qv"])  # plain LoRA is served over it
    finally:
        llm.close()


async def test_model_card_and_metrics_say_the_base_format(fp8_bases, aiohttp_client, tmp_path):
    import asyncio

    from kubelora.engine.config import EngineConfig
    from kubelora.engine.server.app import LIFECYCLE, build_app, build_engine
    from kubelora.engine.server.config import ServerConfig

    _, build = fp8_bases
    config = ServerConfig(engine=EngineConfig(model_dir=str(build("FP8_BLOCK")), max_lora_rank=8, max_model_len=64),
                          host="127.0.0.1", port=0, adapter_cache_dir=str(tmp_path / "cache"))
    app = build_app(config, build_engine)
    client = await aiohttp_client(app)
    await asyncio.wait_for(app[LIFECYCLE].done.wait(), 60)
    assert app[LIFECYCLE].failure is None, app[LIFECYCLE].failure
    base = (await (await client.get("/v1/models")).json())["data"][0]
    assert base["format"] == "fp8-block128x128-dynamic-group" and base["weight_bytes"] > 0
    metrics = await (await client.get("/metrics")).text()
    assert 'kubelora_base_model_info{format="fp8-block128x128-dynamic-group",model=' in metrics
    assert f"kubelora_base_weight_bytes {float(base['weight_bytes'])}" in metrics


# ---- on the GPU (marker gpu: deselected without one) ----------------------------------------------------------

CUDA_LOGIT_TOLERANCE = {"FP8_DYNAMIC": 0.5, "FP8": 0.5, "FP8_BLOCK": 0.5}  # bf16 logits, inputs quantized to FP8


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_cuda_fp8_matmul_close_to_dequantized_reference(preset, enforce_eager, fp8_bases, prompt_ids,
                                                        peft_reference):
    """On CUDA in bfloat16 the projections run torch's scaled FP8 matmul with inputs quantized as the checkpoint
    says: logits within the preset's tolerance of the dequantized reference (float32, inputs not quantized)."""
    material, build = fp8_bases
    prompts = [prompt_ids(i, 6 + 3 * i) for i in range(len(BATCH))]
    _, results = run_batch(build(preset), material, prompts, device="cuda", dtype="bfloat16",
                           enforce_eager=enforce_eager)
    expected = reference_logits_of(build(preset), material, prompts, results, peft_reference)
    for name, prompt, result, logits in zip(BATCH, prompts, results, expected):
        assert (result.prompt_logits - logits[: len(prompt)]).abs().max() < CUDA_LOGIT_TOLERANCE[preset], name


@pytest.mark.gpu
def test_cuda_transformers_fine_grained_fp8_checkpoint(fp8_bases, prompt_ids, tmp_path):
    """A quant_method fp8 checkpoint as transformers writes it (on a GPU), served by the engine in float32 on CPU
    (weights dequantized): its greedy tokens equal transformers' dequantizing load of the same file."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    material, _ = fp8_bases
    out = tmp_path / "fp8"
    model = AutoModelForCausalLM.from_pretrained(material.model_dir, dtype=torch.bfloat16, device_map="cuda",
                                                 quantization_config=FineGrainedFP8Config(weight_block_size=[128, 128]))
    model.save_pretrained(out)
    for path in material.model_dir.glob("tokenizer*"):
        shutil.copy(path, out / path.name)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    reference = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=FineGrainedFP8Config(weight_block_size=[128, 128],
                                                                           dequantize=True))
    prompt = prompt_ids(1, 12)
    llm = LLM(out, max_lora_rank=8)
    try:
        params = SamplingParams(max_tokens=NUM_DECODE, temperature=0.0, ignore_eos=True, return_logits=True)
        result = llm.generate([prompt], params)[0]
    finally:
        llm.close()
    with torch.no_grad():
        expected = reference(torch.tensor([prompt + result.token_ids[:-1]])).logits[0]
    assert expected[len(prompt) - 1 :].argmax(-1).tolist() == result.token_ids
