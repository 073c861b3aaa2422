"""dataflow/startup_gc.py: the collector paused for a process's start-up and on again after it;
a pause someone else made is theirs to undo."""

from __future__ import annotations

import gc

from dataflow import startup_gc


def test_resume_undoes_its_own_pause_once_and_leaves_anothers_alone():
    assert gc.isenabled()      # tests run with the collector on (tests/conftest.py resumes it)
    try:
        startup_gc.pause()
        assert not gc.isenabled()
        startup_gc.resume()
        assert gc.isenabled()
        startup_gc.resume()    # a second resume changes nothing
        assert gc.isenabled()
        gc.disable()           # someone else's pause: pause() and resume() leave it as it is
        startup_gc.pause()
        startup_gc.resume()
        assert not gc.isenabled()
    finally:
        gc.enable()
