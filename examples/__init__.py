"""Worked examples of the engine on real models and data, one folder each with its README."""
