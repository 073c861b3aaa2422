"""The learner's update on a step's samples (ppo_update.py) and the memory-bounded passes it and the
critic and reference take: token-budget micro-batches, packed (padding-free) forwards, the compile warm-up."""
