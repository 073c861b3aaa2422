"""The real-model recipe: SmolLM2-135M-Instruct learns arithmetic with GRPO (README.md here).
Model conversion (smollm2.py), task data (make_arithmetic.py), the training reward
(last_number_reward.py), the held-out judge (heldout.py). Each runs as
`python examples/smollm2_arithmetic/NAME.py ...`; tests and bench/ import them."""
