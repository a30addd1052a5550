"""Repeat launches of a compiled Triton kernel without the JIT's per-call dispatch.

`JITFunction.run` binds and specializes every argument and looks the compiled kernel up on every call; the
serving benchmark's profile (docs/serving.md) put about half of each LoRA call's host time there. Within one
step every layer launches the same kernels with the same integer arguments and tensors of the same dtypes and
alignment, so after the first launch the compiled kernel is launched directly (`CompiledKernel[grid]`), as
long as everything Triton specializes on is unchanged and no profiler hooks launches; otherwise the launch
goes through the JIT again.
"""

from __future__ import annotations

import torch
from triton import knobs
from triton.compiler.compiler import CompiledKernel


def specialization_key(args: tuple) -> tuple:
    """What a launch's compiled kernel depends on among its runtime arguments.

    Triton specializes integers on their value (== 1, divisible by 16) and pointers on their dtype and on
    16-byte alignment; this key is stricter for integers (the exact value), so equal keys mean the same kernel.
    """
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args)


def has_launch_hooks() -> bool:
    """A profiler's launch hook is installed (Triton 3.6: a function or None; later: a chain of them)."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def is_compiled(kernel: object) -> bool:
    # Under the CPU interpreter a launch returns no compiled kernel: every launch then goes through the JIT.
    return isinstance(kernel, CompiledKernel)


class RepeatLaunch:
    """One kernel with one grid and constexprs, launched many times (a step's layers); see the module doc."""

    def __init__(self, fn, grid: tuple[int, ...], constexprs: dict) -> None:
        self.fn = fn
        self.grid = grid
        self._grid3 = tuple(grid) + (1,) * (3 - len(grid))  # a compiled kernel's launcher takes all three
        self.constexprs = constexprs  # constexpr arguments and launch options (num_warps, num_stages, ...)
        self._kernel = None
        self._key: tuple | None = None
        self._tail: tuple = ()  # the constexpr arguments' values in signature order, after the runtime ones

    def __call__(self, *args) -> None:
        """Launch with the runtime arguments, in signature order (the constexprs come from the constructor)."""
        key = specialization_key(args)
        if self._kernel is not None and key == self._key and not has_launch_hooks():
            self._kernel[self._grid3](*args, *self._tail)
            return
        kernel = self.fn[self.grid](*args, **self.constexprs)
        if is_compiled(kernel):
            self._kernel, self._key = kernel, key
            self._tail = tuple(self.constexprs[name] for name in self.fn.arg_names[len(args):])
