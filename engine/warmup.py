"""Start-up warm-up: the eager (prefill-shaped) forward run once per launch shape before any request arrives.

Triton compiles a kernel the first time it sees a set of constexprs (tile heights, LoRA launch configs, head
sizes); the first requests would otherwise wait for those compiles. Each warm-up step is one sequence of n
tokens on the pad block (the KV block no sequence owns), with and without one LoRA slot whose scale is 0 over
pool rows 0..max_lora_rank (the pool is zeros at start-up, and 0 x finite adds nothing either way); at the
largest size also one step whose second half has no adapter (the rotary kernel's variant that skips the tokens
kernels/lora_rotary.py rotates).

`warm_up_requests` then runs a few requests through the engine's own step loop: the host side of a step (input
packing, the last-token gather, the sampling stage's greedy and sampled paths, penalties, logprobs,
detokenizing) launches PyTorch kernels that the forward alone never runs, and CUDA loads each kernel's module on
its first launch (lazy loading): on an H200 the first request paid about 25 ms for those (index and argmax
kernels) before this ran.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from kubelora.engine.adapters.pool import SlotView
from kubelora.engine.model.config import LORA_MODULES
from kubelora.engine.runner import ModelRunner
from kubelora.engine.sampling_params import SamplingParams
from kubelora.engine.scheduler import Batch

log = logging.getLogger(__name__)


OFF_GRID_SIZE = 100  # a step length that is no multiple of 16


def warm_up_sizes(max_num_batched_tokens: int) -> list[int]:
    """Step sizes whose launch shapes differ: every power of two from 16 up (the LoRA kernels' tile heights, tile
    counts and K splits and the attention query blocks change with them), the step budget itself, and one length
    off the multiples of 16 (Triton specializes integer arguments on divisibility by 16, so such lengths compile
    variants of their own). On a fresh machine a size missing here costs its first request about a second."""
    top = max_num_batched_tokens
    sizes = {1 << k for k in range(4, top.bit_length())} | {top, OFF_GRID_SIZE}
    return sorted(n for n in sizes if 16 <= n <= top)


def warm_up(runner: ModelRunner, sizes: list[int], pad_block: int, max_lora_rank: int) -> float:
    """Start-up: every size eagerly without LoRA and with one slot adapting every module at max_lora_rank."""
    ranks = {m: max_lora_rank for m in LORA_MODULES}
    return _run_sizes(runner, sizes, pad_block, [None, ranks])


def warm_up_adapter_shape(runner: ModelRunner, sizes: list[int], pad_block: int, ranks: dict[str, int]) -> float:
    """Every size eagerly with one slot of these module ranks (a registered adapter's): the LoRA kernels' launch
    configs and their constexprs follow the adapted slices and ranks, so a shape the start-up warm-up did not run
    would compile on its first prefill."""
    return _run_sizes(runner, sizes, pad_block, [ranks])


def _run_sizes(runner: ModelRunner, sizes: list[int], pad_block: int, shapes: list[dict[str, int] | None]) -> float:
    """Returns the seconds it took; shapes: module ranks of the one LoRA slot (scale 0), None: no LoRA. Each step
    runs through the step executor at its own sizes, as an eager step of a request does."""
    started = time.perf_counter()
    views = [None if ranks is None else SlotView(row_start={m: 0 for m in ranks}, rank=dict(ranks),
                                                 scale={m: 0.0 for m in ranks}) for ranks in shapes]
    block_size = runner.steps.general.block_size
    with torch.inference_mode():
        for num in sizes:
            table = (pad_block,) * math.ceil(num / block_size)
            batches = [Batch(chunks=(_Chunk(num, table, -1 if view is None else 0),),
                             slots=() if view is None else (view,)) for view in views]
            if num == sizes[-1]:  # base-model and adapter tokens in one step (the rotary kernel's token mask)
                batches += [Batch(chunks=(_Chunk(num // 2, table, 0), _Chunk(num - num // 2, table, -1)), slots=(view,))
                            for view in views if view is not None]
            for batch in batches:
                runner.steps.run(runner.step_of(batch, [num - 1]), is_eager=True)
    if runner.config.device.type == "cuda":
        torch.cuda.synchronize(runner.config.device)
    return time.perf_counter() - started


WARM_UP_PROMPT_LEN = 20
# Alone first (a greedy-only step takes its own shortcut), then the sampled paths together in one batch.
WARM_UP_REQUESTS = (
    (SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),),
    (SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
     SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True),
     SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=0, presence_penalty=0.1,
                    frequency_penalty=0.1, repetition_penalty=1.1, logit_bias=((1, 1.0),), ignore_eos=True,
                    logprobs=2, prompt_logprobs=1)),
)


def warm_up_requests(engine) -> float:
    """Run WARM_UP_REQUESTS through `engine`'s add_request / step loop (before it serves anything); seconds.
    The prompt is shortened to fit max_model_len, and a request waits for queue room (max_waiting)."""
    started = time.perf_counter()
    vocab = engine.model_config.vocab_size
    length = min(WARM_UP_PROMPT_LEN, engine.max_model_len - 1)
    if length < 1:
        return 0.0
    prompt = [(7 * i + 3) % vocab for i in range(length)]
    for group in WARM_UP_REQUESTS:
        for i, params in enumerate(group):
            while not engine.has_waiting_room():
                engine.step()
            engine.add_request(f"kubelora-warm-up-{len(group)}-{i}", prompt, params)
        while engine.has_unfinished():
            engine.step()
    return time.perf_counter() - started


class _Chunk:
    """The fields of a ScheduledChunk that `ModelRunner.step_of` reads: a prompt's first num tokens, written into
    the pad block."""

    def __init__(self, num: int, block_table: tuple[int, ...], slot: int) -> None:
        self.token_ids = [0] * num
        self.start_pos = 0
        self.block_table = block_table
        self.slot = slot
