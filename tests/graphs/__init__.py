"""Small graphs and node kinds that exercise the engine in tests (importable by the actors)."""
