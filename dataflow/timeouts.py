"""Timeouts that the driver and the node actors share (a module of its own, so the actor side need not
import the driver): wait_within, asyncio.wait_for without its Python 3.11 race."""

from __future__ import annotations

import asyncio
import sys


async def wait_within(aw, timeout_s: float):
    """`await aw`, or TimeoutError after timeout_s: asyncio.wait_for without its Python 3.11 race.
    There, a cancellation that lands as `aw` completes is swallowed: wait_for returns the result
    (CPython gh-86296, fixed in 3.12). A Ctrl-C during a checkpoint's capture was lost so, and the
    run went on to its max_steps (tests/integration/test_checkpoint.py's resume test, once, on a loaded machine).
    asyncio.timeout (3.11+) re-raises it. Python 3.10 keeps wait_for."""
    if sys.version_info < (3, 11):
        return await asyncio.wait_for(aw, timeout_s)
    async with asyncio.timeout(timeout_s):
        return await aw
