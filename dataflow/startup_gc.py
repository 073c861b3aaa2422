"""Python's cyclic garbage collector paused while a process starts (the driver until Ray starts,
each node's actor until its setup is done). Importing torch and transformers creates a few hundred
thousand objects that live as long as the process, and every generation-2 pass their allocation
triggers on the way rescans all of them (bench/startup_cpu.py: the demo's start-up, before and after).
Nothing is frozen afterwards (gc.freeze): an object made during set-up and dropped later, in a
cycle, would then never be freed (a KV cache a phase switch releases, say)."""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Stop automatic collection until resume(); a no-op if something else already stopped it."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Collect automatically again. Only undoes this module's own pause (a no-op otherwise, and
    the second time)."""
    global _paused
    if _paused:
        _paused = False
        gc.enable()
