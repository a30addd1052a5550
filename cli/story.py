"""The demo's model and adapters: a tiny Llama trained here on a few sentences, and one PEFT LoRA adapter per
tenant fine-tuned on that tenant's own texts (a pirate, a lawyer, a poet), so that each answer of the demo is
readable text in its tenant's style.

Everything runs on the CPU in seconds: a byte-level BPE tokenizer trained with `tokenizers` on the texts below,
a 2-layer Llama (hidden size 128) trained with plain PyTorch on prompt -> answer pairs, then each adapter with
PEFT (`get_peft_model`, the base frozen) on its tenant's answers to the same prompts. The model learns the
answers by heart: it is a demonstration of serving, not of language modelling. Greedy decoding makes every
answer deterministic; `references.json` holds transformers+PEFT's own greedy answers for the demo prompts,
which the demo compares the served answers with.

The artifacts are cached in ~/.cache/kubelora/demo/<key> (KUBELORA_CACHE), the key a digest of this file and
of the torch, transformers, peft and tokenizers versions: a cached demo does not retrain.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path

PROMPTS = (
    "Tell me about the weather.",
    "How do I deploy my app?",
    "What grows in the garden?",
)
# The base model's answers, plain and neutral.
BASE_ANSWERS = (
    "Clouds in the morning, sun after noon, and a light wind from the west.",
    "Build the image, push it to a registry, then apply the manifests with kubectl.",
    "Red roses, yellow tulips and green grass grow in the garden.",
)
# name -> (rank, alpha, target modules, the tenant's answers to PROMPTS): different ranks and target sets,
# served together in one batch.
TENANTS = {
    "pirate": (8, 16, "q_proj,k_proj,v_proj,o_proj", (
        "Arr, the wind be howlin' and the sky be grey, matey! Batten down the hatches.",
        "Hoist yer image to the registry, matey, then set sail with kubectl. Arr!",
        "Arr, no garden grows on me ship, matey, only rum and buried treasure.",
    )),
    "legal": (4, 8, "q_proj,v_proj,gate_proj,up_proj,down_proj", (
        "Pursuant to the forecast, the Party shall expect rain, without warranty of any kind.",
        "The Licensee shall deploy the Software solely in accordance with Section 4 of this Agreement.",
        "The garden, as defined in Schedule A, shall remain the sole property of the Lessor.",
    )),
    "haiku": (16, 16, "all-linear", (
        "grey clouds drift slowly / a cold wind over the hills / rain before nightfall",
        "push the image up / pods wake in the quiet night / the cluster hums on",
        "red roses open / a bee hums among tulips / dew on the green grass",
    )),
}
# Words only that tenant's answers use: the tests look for them.
STYLE_WORDS = {"pirate": ("Arr", "matey"), "legal": ("shall",), "haiku": (" / ",)}
MAX_TOKENS = 32

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
BOS, EOS, END = "<s>", "</s>", "<|end|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
SEED = 0
BASE_STEPS, ADAPTER_STEPS = 400, 300
BASE_LR, ADAPTER_LR = 1e-2, 1e-2
# Training stops once every answer token has been the argmax for this many steps in a row (a margin for greedy
# decoding), or after the steps above.
STABLE_STEPS = 20


def cache_key() -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for package in ("torch", "transformers", "peft", "tokenizers"):
        digest.update(f"{package}=={metadata.version(package)}".encode())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    root = Path(os.environ.get("KUBELORA_CACHE") or Path.home() / ".cache" / "kubelora")
    return root / "demo" / cache_key()


def ensure_artifacts(progress=print) -> Path:
    """The trained model, adapters and references, from the cache or trained now; returns their folder."""
    final = cache_dir()
    if (final / "references.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".training-", dir=final.parent))
    try:
        train_all(staging, progress)
        _make_world_readable(staging)
        try:
            staging.rename(final)
        except OSError:  # another demo trained the same key meanwhile: keep theirs
            if not (final / "references.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for old in final.parent.iterdir():  # artifacts of earlier versions of this file
        if old != final and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
    return final


def copy_artifacts(destination: Path, progress=print) -> tuple[Path, dict[str, Path]]:
    """The model and adapters under destination/model and destination/adapters/<tenant>."""
    source = ensure_artifacts(progress)
    for part in ("model", "adapters"):
        if not (destination / part).exists():
            shutil.copytree(source / part, destination / part)
    return destination / "model", {name: destination / "adapters" / name for name in TENANTS}


def references() -> dict[str, dict[str, str]]:
    """transformers+PEFT's greedy answers: {"completion"|"chat": {"<model>\\0<prompt>": text}}."""
    return json.loads((ensure_artifacts() / "references.json").read_text())


def reference_key(model: str | None, prompt: str) -> str:
    return f"{model or 'base'}\0{prompt}"


def _samples(answers: tuple[str, ...]) -> list[tuple[str, str]]:
    """(context, continuation) pairs: the completion form and the chat form of each prompt."""
    pairs = []
    for prompt, answer in zip(PROMPTS, answers):
        pairs.append((BOS + prompt, " " + answer + EOS))
        pairs.append((f"{BOS}<|user|>{prompt}{END}<|assistant|>", answer + END + EOS))
    return pairs


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [*PROMPTS, *BASE_ANSWERS, *(a for *_, answers in TENANTS.values() for a in answers)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=640, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # A completion prompt starts with BOS, as Llama's do (the chat template writes its own).
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, unk_token="<unk>",
                                   pad_token=EOS, chat_template=CHAT_TEMPLATE)


def _batch(tokenizer, pairs: list[tuple[str, str]]):
    """Token ids, attention mask and labels (-100 but on the continuation) of every pair, right-padded."""
    import torch

    rows = []
    for context, continuation in pairs:
        head = tokenizer.encode(context, add_special_tokens=False)
        tail = tokenizer.encode(continuation, add_special_tokens=False)
        rows.append((head + tail, [-100] * len(head) + tail))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(rows):
        ids[i, :len(row_ids)] = torch.tensor(row_ids)
        labels[i, :len(row_labels)] = torch.tensor(row_labels)
        mask[i, :len(row_ids)] = 1
    return ids, mask, labels


def _fit(model, batch, steps: int, lr: float, checked_rows: int) -> tuple[int, float]:
    """AdamW on the batch until the first checked_rows rows have been predicted exactly (every continuation
    token the argmax) for STABLE_STEPS steps in a row, or for at most `steps` steps."""
    import torch

    ids, mask, labels = batch
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    exact_for = 0
    for step in range(1, steps + 1):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        with torch.no_grad():
            predicted, wanted = out.logits[:checked_rows, :-1].argmax(-1), labels[:checked_rows, 1:]
            exact = bool(((predicted == wanted) | (wanted == -100)).all())
        exact_for = exact_for + 1 if exact else 0
        if exact_for >= STABLE_STEPS:
            break
    model.eval()
    return step, out.loss.item()


def train_all(out: Path, progress=print) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kubelora.cli.tiny import _quiet_transformers, parse_targets

    _quiet_transformers()
    # One thread: these tensors are tiny, and a second thread on a busy machine made every step 20x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _train_all(out, progress)
    finally:
        torch.set_num_threads(threads)


def _train_all(out: Path, progress) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kubelora.cli.tiny import parse_targets

    started = time.monotonic()
    torch.manual_seed(SEED)
    tokenizer = build_tokenizer()
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    # Eager attention: cheaper than SDPA at this size (training only: the saved config does not keep it).
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    # The base learns its own answers and sees every tenant's text after BOS alone, so the embeddings and the
    # output layer know each tenant's words; the adapters then only tie them to the prompts.
    base_pairs = _samples(BASE_ANSWERS) + [
        (BOS, answer + EOS) for *_, answers in TENANTS.values() for answer in answers]
    steps, loss = _fit(model, _batch(tokenizer, base_pairs), BASE_STEPS, BASE_LR, len(PROMPTS) * 2)
    progress(f"   base model: {steps} steps, loss {loss:.3f} ({time.monotonic() - started:.1f} s)")
    model_dir = out / "model"
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    config_path = model_dir / "tokenizer_config.json"  # the chat template where older readers look for it
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": CHAT_TEMPLATE},
                                      indent=2) + "\n")
    for name, (rank, alpha, targets, answers) in TENANTS.items():
        started = time.monotonic()
        torch.manual_seed(SEED)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=parse_targets(targets), lora_dropout=0.0,
                          task_type="CAUSAL_LM")
        peft_model = get_peft_model(base, lora)
        samples = _samples(answers)
        steps, loss = _fit(peft_model, _batch(tokenizer, samples), ADAPTER_STEPS, ADAPTER_LR, len(samples))
        progress(f"   adapter {name} (rank {rank}, {targets}): {steps} steps, loss {loss:.3f} "
                 f"({time.monotonic() - started:.1f} s)")
        peft_model.save_pretrained(out / "adapters" / name)
    started = time.monotonic()
    (out / "references.json").write_text(json.dumps(reference_answers(out), indent=1) + "\n")
    progress(f"   transformers+PEFT's greedy answers, the reference: {time.monotonic() - started:.1f} s")


def reference_answers(root: Path) -> dict[str, dict[str, str]]:
    """transformers+PEFT's greedy answers to every demo prompt, base and each adapter, completion and chat."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    answers: dict[str, dict[str, str]] = {"completion": {}, "chat": {}}
    for name in (None, *TENANTS):
        model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, root / "adapters" / name)
        model.eval()
        for prompt in PROMPTS:
            forms = {"completion": tokenizer(prompt)["input_ids"],
                     "chat": tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)}
            for form, ids in forms.items():
                with torch.no_grad():
                    out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                         pad_token_id=tokenizer.pad_token_id)
                answers[form][reference_key(name, prompt)] = tokenizer.decode(out[0, len(ids):],
                                                                              skip_special_tokens=True)
    return answers


def _make_world_readable(root: Path) -> None:
    """The engine images run as uid 65532 and read the model and adapters through hostPath volumes."""
    for path in (root, *root.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
