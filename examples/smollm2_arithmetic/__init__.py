"""Helper programs around the engine: model conversion (smollm2.py), task data (make_arithmetic.py),
held-out evaluation (heldout.py). Each runs as `python tools/NAME.py ...`; tests import them."""
