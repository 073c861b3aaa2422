"""rl/model/gpu_turns.py: the phase switch's turns are exclusive across processes, a waiting
process gets the turn as soon as the holder gives it, and a holder that dies gives it up."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

from rl.model.gpu_turns import GpuTurn


def _hold(path: str, seconds: float, ready) -> None:
    turn = GpuTurn(path)
    turn.take()
    ready.set()
    time.sleep(seconds)
    turn.give()


def test_a_turn_waits_for_the_holder_and_is_free_after_it_gives_or_dies(tmp_path):
    path = str(tmp_path / "gpu.lock")
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold, args=(path, 1.0, ready))
    holder.start()
    assert ready.wait(30)
    mine = GpuTurn(path)
    waited = mine.take()
    assert 0.3 < waited < 20 and mine.held
    mine.give()
    holder.join(10)

    ready.clear()
    killed = ctx.Process(target=_hold, args=(path, 600.0, ready))
    killed.start()
    assert ready.wait(30)
    os.kill(killed.pid, signal.SIGKILL)
    killed.join(10)
    t = time.perf_counter()
    assert mine.take() < 5 and time.perf_counter() - t < 5    # the kernel dropped the dead holder's lock
    assert mine.take() == 0.0                                   # held already: no second wait
    mine.close()
    assert not mine.held
