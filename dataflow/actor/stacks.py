"""Where a replica's code is right now: the Python stacks of its threads, for the stall report
(dataflow/driver/stall.py). "busy in 'train' for 190 s" says which node; the stack says where (a compile,
a kernel launch, a lock, a loop).

Each host (dataflow/actor/host.py) runs a StackServer: a daemon thread of its own that answers the
driver on a TCP socket of its own (ask()), outside Ray. A Ray call would not do: Ray hands every
call to an actor through one dispatch thread, and when a node blocks its event loop just as
another call of the actor completes, that thread blocks too (Ray's fiber waits on a future the
blocked loop would set), so even a call in a concurrency group of its own never arrives
(tests/integration/test_stall.py's blocked-loop test, a third of its runs on a loaded machine). The driver
prints a short form under the root replicas (short_lines) and writes every replica's full stacks
to <run>/stall-<n>.txt (write_file). No Ray import here.

A thread counts as running node code when it has a frame outside the standard library and Ray's
package (the project's and the user's code, torch, ...), unless that frame is a library's and the
thread sits in a standard-library wait (an idle pool worker of torch's, say). So the event loop
idle in its selector, idle `asyncio.to_thread` workers and Ray's own threads are left out, while a
node thread waiting on a lock in the node's own code is kept: that lock is the answer.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import secrets
import socket
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Callable

MAX_FRAMES = 100    # frames kept per thread (innermost), for the file; deep recursion stays readable
SHORT_LINES = 8     # lines per thread in the report's short form
SHORT_THREADS = 4   # threads per replica in the report; the file has all of them

_PROJECT = str(Path(__file__).resolve().parents[2]) + os.sep  # the checkout that holds dataflow/
_STDLIB = tuple({str(Path(sysconfig.get_paths()[k]).resolve()) + os.sep for k in ("stdlib", "platstdlib")})


def frame_of(path: str, line: int, func: str) -> list:
    """[path, short path, line, function, kind], kind being "own" (the project's, the user's),
    "lib" (an installed package), "ray" or "std" (the standard library)."""
    parts = path.replace("\\", "/").split("/")
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            rest = parts[len(parts) - 1 - parts[::-1].index(marker) + 1:]
            return [path, "/".join(rest), line, func, "ray" if rest[:1] == ["ray"] else "lib"]
    if path.startswith("<frozen") or path.startswith(_STDLIB):
        short = next((path[len(d):] for d in _STDLIB if path.startswith(d)), path)
        return [path, short, line, func, "std"]
    if path.startswith(_PROJECT):
        return [path, path[len(_PROJECT):], line, func, "own"]
    roots = [p.rstrip(os.sep) + os.sep for p in sys.path if p and path.startswith(p.rstrip(os.sep) + os.sep)]
    return [path, path[len(max(roots, key=len)):] if roots else path, line, func, "own"]


def _frames(f) -> list[list]:
    """Innermost first, at most MAX_FRAMES."""
    out = []
    while f is not None and len(out) < MAX_FRAMES:
        out.append(frame_of(_path(f.f_code.co_filename), f.f_lineno, f.f_code.co_name))
        f = f.f_back
    return out


def node_code(frames: list[list]) -> bool:
    """See the module docstring."""
    if any(kind == "own" for *_, kind in frames):
        return True
    return any(kind == "lib" for *_, kind in frames) and bool(frames) and frames[0][4] != "std"


def capture(skip_ident: int | None = None, loop_ident: int | None = None, coro=None) -> list[dict]:
    """Every thread of this process but `skip_ident` (the capturing one): {"thread", "node_code",
    "frames"}, node-code threads first. When the event loop's thread (`loop_ident`) runs none of
    the node's code, the suspended `coro`'s await chain is added as "run() awaits": where a node
    that waits on something of its own (an event, a future, a sleep) is waiting."""
    names = {t.ident: t.name for t in threading.enumerate()}
    threads = []
    for ident, frame in sys._current_frames().items():
        if ident == skip_ident:
            continue
        frames = _frames(frame)
        threads.append({"thread": names.get(ident, f"thread {ident}"), "node_code": node_code(frames),
                        "frames": frames, "loop": ident == loop_ident})
    loop_busy = any(t["loop"] and t["node_code"] for t in threads)
    if coro is not None and not loop_busy:
        try:  # read from another thread while the loop may resume it: a best effort, never an error
            chain = _await_chain(coro)
        except Exception as e:  # noqa: BLE001
            chain = [frame_of("<await chain unreadable>", 0, f"{type(e).__name__}: {e}")]
        if chain:
            threads.append({"thread": "run() awaits", "node_code": True, "frames": chain, "loop": True})
    threads.sort(key=lambda t: not t["node_code"])
    return threads


def _await_chain(coro) -> list[list]:
    """A suspended coroutine's frames, innermost first, following what each one awaits
    (Task.get_stack gives only the outermost: a suspended frame has no f_back; and Ray's task
    around an actor method is a Cython coroutine without frames, hence the node's own coroutine)."""
    frames = []
    while coro is not None and len(frames) < MAX_FRAMES:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        frames.append(frame_of(_path(frame.f_code.co_filename), frame.f_lineno, frame.f_code.co_name))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames[::-1]


class StackServer:
    """Answers ask() with capture()'s threads, from a daemon thread listening on `host`. Each
    request must bring the server's token (a random secret the driver learns through Ray)."""

    def __init__(self, host: str, threads: Callable[[int], list[dict]]):
        self._threads = threads  # threads(skip_ident) -> capture(...) of the host's process
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._socket = socket.create_server((host, 0), family=family)
        except OSError:  # an address Ray reports but this process cannot bind: every interface
            self._socket = socket.create_server(("", 0), family=family)
        self.token = secrets.token_hex(16)
        self.address = (host, self._socket.getsockname()[1], self.token)
        threading.Thread(target=self._serve, name="dataflow stack server", daemon=True).start()

    def _serve(self) -> None:
        me = threading.get_ident()
        while True:
            try:
                conn, _ = self._socket.accept()
                with conn, conn.makefile("rb") as request:
                    conn.settimeout(5.0)
                    if hmac.compare_digest(request.readline(200).strip(), self.token.encode()):
                        conn.sendall(json.dumps(self._threads(me)).encode())
            except Exception:  # noqa: BLE001 - the driver gave up, no file handles left, ...: the
                time.sleep(0.1)    # driver reports "no stacks"; this thread must live to answer the next


async def ask(address: tuple | list) -> list[dict]:
    """A StackServer's threads (its `address`: host, port, token)."""
    host, port, token = address
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(token.encode() + b"\n")
        await writer.drain()
        return json.loads(await reader.read())
    finally:
        writer.close()


def short_lines(thread: dict) -> list[str]:
    """A thread's stack in a few lines, innermost first: where it is now, then the calls that led
    there without the standard library's and Ray's frames (imports, thread pools), each run of one
    package's frames shown by its ends (torch.compile's stacks are 50+ frames deep). Over
    SHORT_LINES, the project's frames are kept before a library's: they say whose call it is."""
    frames = thread["frames"]
    if not frames:
        return []
    rest = [f for f in frames[1:] if f[4] not in ("std", "ray")]
    entries: list[tuple[str, str]] = [(_at(frames[0]), "now")]  # (line, kind)
    i = 0
    while i < len(rest):
        j = i
        if rest[i][4] == "lib":  # the run of frames of the same package
            while j + 1 < len(rest) and rest[j + 1][4] == "lib" and _package(rest[j + 1]) == _package(rest[i]):
                j += 1
        if j - i > 2:
            entries += [(_at(rest[i]), "lib"), (f"... {j - i - 1} frames in {_package(rest[i])}", "lib"),
                        (_at(rest[j]), "lib")]
        else:
            entries += [(_at(f), f[4]) for f in rest[i:j + 1]]
        i = j + 1
    if len(entries) <= SHORT_LINES:
        return [line for line, _ in entries]
    own = [k for k, (_, kind) in enumerate(entries) if kind == "own"][:SHORT_LINES - 3]
    keep = {0, *own}
    keep |= set([k for k in range(1, len(entries)) if k not in keep][:SHORT_LINES - len(keep)])
    shown, last = [], -1
    for k in sorted(keep):
        if k != last + 1:
            shown.append("...")
        shown.append(entries[k][0])
        last = k
    return shown + (["... (the file has the rest)"] if last != len(entries) - 1 else [])


def replica_lines(stacks: list[dict] | None) -> list[str]:
    """The short form of a replica's node-code threads, for under its line in the report."""
    if stacks is None:
        return ["(no stacks: the process did not answer, e.g. a C call that holds the GIL, or the driver "
                "cannot reach its stack server's port)"]
    busy = [t for t in stacks if t["node_code"]]
    if not busy:
        return ["(no thread runs node code: it waits in Ray or the standard library)"]
    lines = []
    for t in busy[:SHORT_THREADS]:
        where = t["thread"] if t["thread"] == "run() awaits" else f"thread {t['thread']}"
        lines.append(f"{where}, innermost first:")
        lines += ["  " + s for s in short_lines(t)]
    if len(busy) > SHORT_THREADS:
        lines.append(f"... and {len(busy) - SHORT_THREADS} more threads running node code (the file has them)")
    return lines


def write_file(path: Path, report: str, stacks: dict[str, list[dict] | None]) -> None:
    """The report, then every replica's threads in Python's traceback layout (innermost last)."""
    out = [report, ""]
    for replica, threads in stacks.items():
        out.append(f"==== {replica} ====")
        if threads is None:
            out += ["(did not answer)", ""]
            continue
        for t in threads:
            out.append(f"--- {t['thread']}{'' if t['node_code'] else ' (idle, or Ray / the standard library only)'}")
            for path_, _, line, func, _ in reversed(t["frames"]):
                out.append(f'  File "{path_}", line {line}, in {func}')
            if len(t["frames"]) == MAX_FRAMES:
                out.append(f"  (only the innermost {MAX_FRAMES} frames)")
        out.append("")
    path.write_text("\n".join(out) + "\n")


def _path(filename: str) -> str:
    return filename if filename.startswith("<") else os.path.abspath(filename)  # "<frozen importlib...>"


def _at(frame: list) -> str:
    return f"{frame[1]}:{frame[2]} {frame[3]}"


def _package(frame: list) -> str:
    return frame[1].split("/", 1)[0]
