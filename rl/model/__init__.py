"""Models and precision: HF causal LMs and the value model, the random-init model's shape, padded
token batches and their log-probs, numeric precision and compiled layers."""
