"""The RL library: models, decoding, precision, algorithm math, built-in tasks and reward functions.

Plain functions and classes with no Ray and no engine: nodes/ builds on them, and so can a script.
"""
