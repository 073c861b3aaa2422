"""Unit tests: pure functions and classes, no Ray and no subprocess (`pytest tests/unit`)."""
