"""`kubelora demo --engine-only`: the engine server on the demo's tiny model, adapters hot-loaded over HTTP,
tenants calling it with the openai SDK in one mixed batch. `--offline` runs the same adapters through the
offline `LLM` API. The default, the whole system on a local Kubernetes control plane, is demo_cluster.py.

The model and the adapters are trained here in seconds (story.py): a tiny Llama and one adapter per tenant,
each answering in its tenant's style (a pirate, a lawyer, a poet). Every answer is greedy and is printed with
whether it equals transformers+PEFT's answer on the same files.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from kubelora.cli import story

# (name, rank, alpha, targets), one per tenant: different ranks and target sets, served together in one batch.
DEMO_ADAPTERS = tuple((name, rank, alpha, targets) for name, (rank, alpha, targets, _) in story.TENANTS.items())
DEMO_PROMPTS = story.PROMPTS
MAX_TOKENS = story.MAX_TOKENS
# The adapter the served demo only registers (it loads on its first request) and the one streamed in chat.
LAZY_ADAPTER, CHAT_ADAPTER = "haiku", "pirate"
READY_TIMEOUT_S = 120


def build_demo_material(workdir: Path) -> tuple[Path, dict[str, Path]]:
    """The demo's model and adapters under workdir (trained once, then copied from the cache)."""
    if not (story.cache_dir() / "references.json").exists():
        print(f"   training them (once, about 30 s on 2 cores; cached in {story.cache_dir()})", flush=True)
    return story.copy_artifacts(workdir, progress=lambda line: print(line, flush=True))


def check_answer(model: str | None, prompt: str, text: str, form: str = "completion") -> bool:
    """Print whether `text` equals transformers+PEFT's greedy answer; True when it does."""
    expected = story.references()[form][story.reference_key(model, prompt)]
    is_same = text == expected
    print(f"   {'':>9}  = transformers+PEFT's answer" if is_same else
          f"   {'':>9}  != transformers+PEFT's answer: {expected!r}")
    note = base_note(prompt, text) if model is None else None
    if note:
        print(f"   {'':>9}  {note}")
    return is_same


def base_note(prompt: str, text: str) -> str | None:
    """What to say beside a base-model answer that is not the one it was trained on (None when it is): the base
    is 2 layers trained for seconds on its answers and every tenant's texts (cli/story.py), and remembers its own
    only in part, so a garbled base answer is the tiny model's, not the serving's."""
    if prompt not in story.PROMPTS:
        return None
    trained = story.BASE_ANSWERS[story.PROMPTS.index(prompt)]
    if text.strip() == trained:
        return None
    return f"(the tiny base model learned little: it was trained on {trained!r}; the adapters are the demo's point)"


def print_answer(model: str | None, prompt: str, text: str) -> None:
    print(f"   [{model or 'base':>9}] {prompt} ->{text}")


def run_demo(workdir: str | None = None, device: str = "cpu", mode: str = "cluster", keep: bool = False) -> int:
    """mode: "cluster" (the whole system), "engine" (one engine server, no Kubernetes), "offline" (LLM API).
    Without workdir the demo works in a temporary folder, removed afterwards unless keep."""
    root = Path(workdir).resolve() if workdir else Path(tempfile.mkdtemp(prefix="kubelora-demo-"))
    try:
        if mode == "cluster":
            from kubelora.cli.demo_cluster import run_cluster_demo

            root.mkdir(parents=True, exist_ok=True)
            root.chmod(0o755)  # engine pods read the model and adapters through hostPath volumes
            return run_cluster_demo(root, keep=keep)
        print(f"== the demo's tiny Llama model and {len(DEMO_ADAPTERS)} PEFT adapters "
              f"({', '.join(story.TENANTS)}) in {root}", flush=True)
        model_dir, adapters = build_demo_material(root)
        if mode == "offline":
            return _run_offline(model_dir, adapters, device)
        return _run_served(root, model_dir, device)
    finally:
        if workdir is None and not keep:
            shutil.rmtree(root, ignore_errors=True)
        elif workdir is None:
            print(f"== kept {root}")


def _requests() -> list[tuple[str, str | None]]:
    names: list[str | None] = [None, *(name for name, *_ in DEMO_ADAPTERS)]
    return [(prompt, name) for prompt in DEMO_PROMPTS for name in names]


def _run_offline(model_dir: Path, adapters: dict[str, Path], device: str) -> int:
    from kubelora.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), max_loras=len(adapters), max_lora_rank=16, max_cpu_loras=8, device=device)
    for name, path in adapters.items():
        llm.load_adapter(name, str(path))
    pairs = _requests()
    results = llm.generate([p for p, _ in pairs], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                           adapters=[a for _, a in pairs])
    print(f"== {len(pairs)} requests, {len(adapters)} adapters + base, one batch (offline API)")
    same = 0
    for (prompt, name), result in zip(pairs, results):
        print_answer(name, prompt, result.text)
        same += check_answer(name, prompt, result.text)
    return _summary(same, len(pairs))


def _summary(same: int, total: int) -> int:
    print(f"== {same} of {total} answers equal transformers+PEFT's")
    return 0 if same == total else 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(root: Path, model_dir: Path, device: str, port: int, admin_port: int) -> subprocess.Popen:
    command = [
        sys.executable, "-P", "-m", "kubelora.cli.main", "engine", "serve", "--model", str(model_dir),
        "--served-model-name", "tiny-llama", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "4",
        "--max-model-len", "256", "--device", device, "--host", "127.0.0.1", "--port", str(port),
        "--admin-port", str(admin_port),
        "--adapter-root", str(root / "adapters"), "--log-level", "warning",
    ]
    return subprocess.Popen(command, env={**os.environ, "PYTHONSAFEPATH": "1"})


def _http(method: str, url: str, body: dict | None = None) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, raw = response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def _wait_ready(base_url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the engine server exited with code {server.returncode}")
        try:
            if _http("GET", f"{base_url}/ready")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the engine server was not ready after {READY_TIMEOUT_S} s")


async def _complete_all(base_url: str) -> list[tuple[str, str | None, str]]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="demo")

    async def one(prompt: str, adapter: str | None) -> tuple[str, str | None, str]:
        response = await client.completions.create(model=adapter or "tiny-llama", prompt=prompt,
                                                   max_tokens=MAX_TOKENS, temperature=0.0)
        return prompt, adapter, response.choices[0].text

    try:
        return await asyncio.gather(*(one(p, a) for p, a in _requests()))
    finally:
        await client.close()


async def _stream_chat(base_url: str, adapter: str, prompt: str) -> str:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="demo")
    try:
        stream = await client.chat.completions.create(
            model=adapter, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
            temperature=0.0, stream=True)
        return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    finally:
        await client.close()


def _show_models(base_url: str) -> None:
    _, models = _http("GET", f"{base_url}/v1/models")
    for card in models["data"]:
        extra = f"parent={card.get('parent')} residency={card.get('residency')} revision={card.get('revision')}"
        print(f"   {card['id']:<10} {extra if card.get('parent') else '(base model)'}")


def _show_metrics(base_url: str) -> None:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(("kubelora_requests_total", "vllm:lora_requests_info", "kubelora_adapter_pool_bytes")):
            print(f"   {line}")


def _run_served(root: Path, model_dir: Path, device: str) -> int:
    port, admin_port = _free_port(), _free_port()
    base_url, admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    print(f"== starting `kubelora engine serve` on {base_url}, admin API on {admin_url} (max-loras 2: three "
          "adapters share two slots)", flush=True)
    server = _start_server(root, model_dir, device, port, admin_port)
    try:
        _wait_ready(base_url, server)
        return _run_scenario(base_url, admin_url)
    finally:
        server.terminate()
        server.wait(timeout=30)


def _run_scenario(base_url: str, admin_url: str) -> int:
    print(f"== hot-loading adapters over HTTP ({LAZY_ADAPTER} registered only: it loads on its first request)")
    for name, *_ in DEMO_ADAPTERS:
        body = {"lora_name": name, "lora_path": name, "preload": name != LAZY_ADAPTER}
        status, answer = _http("POST", f"{admin_url}/v1/load_lora_adapter", body)
        print(f"   load {name}: {status} {answer.get('message') if isinstance(answer, dict) else answer}")
    _show_models(admin_url)
    print(f"== {len(_requests())} concurrent completions through the openai SDK, every adapter and the base model")
    same = total = 0
    for prompt, adapter, text in asyncio.run(_complete_all(base_url)):
        print_answer(adapter, prompt, text)
        same, total = same + check_answer(adapter, prompt, text), total + 1
    prompt = DEMO_PROMPTS[0]
    print(f"== streamed chat with {CHAT_ADAPTER}: {prompt}")
    text = asyncio.run(_stream_chat(base_url, CHAT_ADAPTER, prompt))
    print(f"   [{CHAT_ADAPTER:>9}] {text}")
    same, total = same + check_answer(CHAT_ADAPTER, prompt, text, form="chat"), total + 1
    print("== bad input gets a clear error, and the server keeps serving")
    status, answer = _http("POST", f"{admin_url}/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "../../etc"})
    print(f"   load ../../etc: {status} {answer['error']['message'] if isinstance(answer, dict) else answer}")
    gone = DEMO_ADAPTERS[0][0]
    status, answer = _http("POST", f"{admin_url}/v1/unload_lora_adapter", {"lora_name": gone})
    print(f"   unload {gone}: {status}")
    status, answer = _http("POST", f"{base_url}/v1/completions", {"model": gone, "prompt": "hi"})
    print(f"   completion for the unloaded {gone}: {status} {answer['error']['message']}")
    _show_models(admin_url)
    print("== a few metrics from /metrics")
    _show_metrics(base_url)
    return _summary(same, total)
