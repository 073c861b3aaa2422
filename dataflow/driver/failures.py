"""What the driver's calls to the node actors returned: gathering them, telling a failure from a
result, and reporting the root cause by name (NodeFailed, or UserError for a mistake in a setting).

A host's run() or connect() returns a dict ({"status": "failed", ...} when its node raised) or, when
the actor itself died or Ray could not run the call, the exception in its place (result_of).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from dataflow.errors import NodeFailed, UserError, one_line

ROOT_CAUSE_GRACE_S = 2.0  # how long a channel error waits for the failure of the node it names


async def awaitable(ref):
    return await ref


async def unless_the_run_ends(aw, running: dict, ends_run) -> tuple[Any, dict]:
    """`await aw` (a checkpoint save, a restart: seconds under load, while the driver would not
    see a node die), raced against the run() calls in `running` (future -> replica). Returns
    (its result, {}); or, as soon as a run() ends the run (`ends_run(replica, result)`), (None,
    {replica: result}) with those taken out of `running`, and `aw` cancelled. A run() that ends
    without ending the run (a process Ray restarts) stays in `running`: the driver's next wait
    finds it done."""
    task = asyncio.ensure_future(aw)
    watched = {fut: name for fut, name in running.items() if not fut.done()}
    try:
        while not task.done():
            done, _ = await asyncio.wait([task, *watched], return_when=asyncio.FIRST_COMPLETED)
            ended = {watched.pop(fut): result_of(fut) for fut in done if fut in watched}
            ending = {name: r for name, r in ended.items() if ends_run(name, r)}
            if ending and not task.done():
                for fut in [fut for fut, name in running.items() if name in ending]:
                    del running[fut]
                return None, ending
        return task.result(), {}
    finally:
        if not task.done():  # the run ends (or the driver was cancelled: Ctrl-C)
            task.cancel()
            await asyncio.wait([task])


async def gather_named(refs: dict) -> dict:
    names = list(refs)
    results = await asyncio.gather(*(awaitable(refs[n]) for n in names), return_exceptions=True)
    return dict(zip(names, results))


async def gather_setups(refs: dict) -> dict:
    """Like gather_named, but returns at the first failure: a node whose setup waits for a peer
    (e.g. the weight push rendezvous, dataflow/weights/sync.py) would otherwise hold up the report of
    that peer's failed setup until its own wait timed out."""
    futures = {asyncio.ensure_future(awaitable(ref)): name for name, ref in refs.items()}
    results, pending = {}, set(futures)
    try:
        while pending and not any(failed(r) for r in results.values()):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            results.update({futures[f]: result_of(f) for f in done})
    finally:  # also on Ctrl-C / SIGTERM during start-up: the shutdown kills the actors these wait on
        discard(futures)
    return results


def result_of(fut: asyncio.Future) -> Any:
    try:
        return fut.result()
    except BaseException as e:  # the actor died, or Ray could not run the call
        return e


def discard(futures) -> None:
    """Drop the run() calls still out when a failure or Ctrl-C ends the run, without asyncio
    logging "Task exception was never retrieved" for each actor that the shutdown kills."""
    for fut in futures:
        if not fut.done():
            fut.cancel()
        elif not fut.cancelled():
            fut.exception()


def failed(result: Any) -> bool:
    return isinstance(result, BaseException) or (isinstance(result, dict) and result.get("status") == "failed")


def is_echo(result: Any) -> bool:
    """A node that failed only because a peer failed or died: a producer it reads from, or the
    other end of a weight push (dataflow/actor/host.py: the failure's "echo")."""
    return isinstance(result, dict) and result.get("status") == "failed" and result.get("echo", False)


async def wait_for_root_cause(results: dict, running: dict) -> None:
    """When every failure so far is an echo (a consumer's channel error), wait briefly for the failure of
    the node it names (a killed actor is noticed by its consumers and the driver at about the
    same time), so that node is reported instead of its echo downstream."""
    deadline = time.monotonic() + ROOT_CAUSE_GRACE_S
    while running and all(is_echo(r) for r in results.values() if failed(r)):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        done, _ = await asyncio.wait(running, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        results.update({running.pop(fut): result_of(fut) for fut in done})


def raise_first_failure(results: dict, not_restarted: dict | None = None) -> None:
    """Raise for the root cause: a dead actor, else a node's own error, else a channel error.
    `not_restarted`: replica -> why its dead process was not restarted (added to its report)."""
    failures = [(name, r) for name, r in results.items() if failed(r)]
    failures.sort(key=lambda f: 0 if isinstance(f[1], BaseException) else 2 if is_echo(f[1]) else 1)
    for name, result in failures:
        raise_if_failed(name, result, (not_restarted or {}).get(name, ""))


def raise_if_failed(name: str, result: Any, not_restarted: str = "") -> None:
    if isinstance(result, BaseException):
        summary = death_summary(result)
        raise NodeFailed(name, summary + (f"; not restarted: {not_restarted}" if not_restarted else ""))
    if isinstance(result, dict) and result.get("status") == "failed":
        if result.get("user_error"):  # a mistake the user can fix (missing file, bad setting)
            raise UserError(f"node '{name}' ({result['phase']}): {result['message']}")
        raise NodeFailed(name, f"{result['error']} (during {result['phase']})", result["traceback"], result["item"])


def death_summary(e: BaseException) -> str:
    from ray.exceptions import ActorDiedError, RayActorError

    if isinstance(e, (ActorDiedError, RayActorError)):
        text = str(e)
        if "SIGKILL" in text or "killed" in text.lower() or "exit" in text.lower():
            return "its process died (killed or crashed); see the node's log with --verbose"
        return "its actor died: " + text.strip().splitlines()[0]
    return one_line(e)
