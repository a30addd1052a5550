"""One step pipeline: a step's shape (shape.py), its static inputs, its graphs and the executor that runs them."""
