"""Repeat launches of a compiled Triton kernel without the JIT's per-call dispatch.

`JITFunction.run` binds and specializes every argument and looks the compiled kernel up on every call; the
engine's host profile (`python -P -m kubelora.bench.host`) put about half of each LoRA call's host time there. Within one
step every layer launches the same kernels with the same integer arguments and tensors of the same dtypes and
alignment, so after the first launch the compiled kernel is launched directly (`CompiledKernel[grid]`), as
long as everything Triton specializes on is unchanged and no profiler hooks launches; otherwise the launch
goes through the JIT again.
"""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict

import torch
from triton import knobs
from triton.compiler.compiler import CompiledKernel

_DTYPE = operator.attrgetter("dtype")


def _picker(positions: list[int]):
    """args -> the tuple of args at these positions (itemgetter returns a bare item for one position)."""
    if len(positions) == 1:
        return lambda args: (args[positions[0]],)
    return operator.itemgetter(*positions) if positions else lambda args: ()


class Specialization:
    """What a launch's compiled kernel depends on among its runtime arguments, recorded from one call's.

    Triton specializes integers on their value (== 1, divisible by 16) and pointers on their dtype and on
    16-byte alignment; this is stricter for integers (the exact value), so a call that `holds` gets the same
    compiled kernel. The check runs on every layer's launch, so it is a few C-level passes, not a loop over the
    arguments in Python.
    """

    def __init__(self, args: tuple) -> None:
        is_tensor = [isinstance(a, torch.Tensor) for a in args]
        self._num_args = len(args)
        self._tensors = _picker([i for i, t in enumerate(is_tensor) if t])
        self._values = _picker([i for i, t in enumerate(is_tensor) if not t])
        tensors = self._tensors(args)
        self._dtypes = list(map(_DTYPE, tensors))
        self._aligned = [p % 16 == 0 for p in map(torch.Tensor.data_ptr, tensors)]
        self._all_aligned = all(self._aligned)
        self._value_args = self._values(args)

    def holds(self, args: tuple) -> bool:
        if len(args) != self._num_args:
            return False
        try:
            if self._values(args) != self._value_args:
                return False
            tensors = self._tensors(args)
            if list(map(_DTYPE, tensors)) != self._dtypes:
                return False
            pointers = list(map(torch.Tensor.data_ptr, tensors))
        except (AttributeError, TypeError, RuntimeError):  # a tensor where a value was, or the other way round
            return False
        if self._all_aligned:  # the usual case: one OR over the addresses
            return not functools.reduce(operator.or_, pointers, 0) & 15
        return [p % 16 == 0 for p in pointers] == self._aligned


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
        self._specialization: Specialization | None = None
        self._tail: tuple = ()  # the constexpr arguments' values in signature order, after the runtime ones

    def __call__(self, *args) -> None:
        """Launch with the runtime arguments, in signature order (the constexprs come from the constructor)."""
        if self._kernel is not None and self._specialization.holds(args) and not has_launch_hooks():
            self._kernel[self._grid3](*args, *self._tail)
            return
        kernel = self.fn[self.grid](*args, **self.constexprs)
        if is_compiled(kernel):
            self._kernel, self._specialization = kernel, Specialization(args)
            self._tail = tuple(self.constexprs[name] for name in self.fn.arg_names[len(args):])


# Launches kept across steps (`shared_launch`): decode steps of one batch shape plan the same launches step after
# step, and each new RepeatLaunch would go through the JIT once per step.
SHARED_LAUNCHES = 256
_shared: OrderedDict[tuple, RepeatLaunch] = OrderedDict()


def shared_launch(fn, grid: tuple[int, ...], constexprs: dict, key: tuple = ()) -> RepeatLaunch:
    """The RepeatLaunch of this kernel, grid and constexprs, the same object for every step that plans it.

    key: the planner's integer launch arguments, so that two projections launching the same kernel and grid
    with other integers keep their own launches instead of taking turns through the JIT. The least recently
    planned of more than SHARED_LAUNCHES are dropped.
    """
    cache_key = (fn, tuple(grid), tuple(sorted(constexprs.items())), key)
    launch = _shared.get(cache_key)
    if launch is None:
        launch = _shared[cache_key] = RepeatLaunch(fn, grid, constexprs)
        while len(_shared) > SHARED_LAUNCHES:
            _shared.popitem(last=False)
    else:
        _shared.move_to_end(cache_key)
    return launch
