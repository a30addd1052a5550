"""One step pipeline for static steps (decode, one sequence's short prefill chunk).

shape.py: a step's `StepShape`, the one place its sizes are rounded; plan.py: the shapes planned for the registered
adapters; layout.py, decode.py, prefill.py: the static layouts a step is filled into; graphs.py: the one cache
of captured graphs; static.py: the executor (fill, replay, or run the same inputs eagerly).
"""
