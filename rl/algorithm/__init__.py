"""Algorithm math as pure torch functions: advantages, policy and value losses, KL, masked reductions,
reward shaping, the learning-rate schedule, validation metrics."""
