"""One step pipeline: every forward pass built one way.

inputs.py: a step's inputs in one device buffer, read alike by eager and replayed steps; shape.py: a static step's
`StepShape`, the one place its sizes are rounded; plan.py: the shapes planned for the registered adapters;
graphs.py: the one cache of captured graphs; executor.py: fill, then replay or run the same inputs eagerly.
"""
