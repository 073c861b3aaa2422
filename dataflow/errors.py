"""Errors the CLI prints as one short message (no traceback): mistakes the user can fix."""

import re


class UserError(Exception):
    """A mistake in a graph file, a --set value, a model directory or a dataset.

    The message names where the mistake is (file:line, node, channel or setting) and what to do.
    `dataflow.run` prints it without a traceback and exits with status 2.
    """


class GraphError(UserError):
    """The graph declaration is invalid (checked before any actor starts)."""


class ConfigError(UserError):
    """A --set key or value does not fit the graph's typed config."""


class SettingError(UserError, ValueError):
    """A setting that does not fit the data or the graph, found while the run goes (a row longer
    than a token budget, a KL coefficient without a reference node): one line, exit 2."""


class NodeFailed(Exception):
    """A node raised or died while the graph ran. Carries the node name and the original traceback."""

    def __init__(self, node: str, summary: str, traceback_text: str = "", item: str = ""):
        self.node = node
        self.summary = summary
        self.traceback_text = traceback_text
        self.item = item
        super().__init__(f"node '{node}' failed: {summary}")


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` of an exception raised inside a library."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def out_of_memory_line(e: BaseException, memory_note: str, share: float) -> str:
    """torch's CUDA out-of-memory message cut to what was asked, what the share allows and what the
    node held (allocated by PyTorch, and reserved but unused: fragmentation), then what the memory
    plan gave the node and the setting that lowers its need (NodeSpec.memory_note), or without a
    plan its share: the host reports it as a user error, one line, no traceback."""
    text = " ".join(str(e).split())
    asked = re.search(r"Tried to allocate [\d.]+ \w+", text)
    allowed = re.search(r"[\d.]+ \w+ allowed", text)
    held = re.search(r"([\d.]+ \w+) is allocated by PyTorch", text)
    unused = re.search(r"([\d.]+ \w+) is reserved by PyTorch but unallocated", text)
    said = "; ".join([m.group(0) for m in (asked, allowed) if m]
                     + ([f"it held {held.group(1)}" + (f" (+{unused.group(1)} reserved, unused)" if unused else "")]
                        if held else [])) or text[:160]
    plan = memory_note or (f"no memory plan for it (share {share:g} of a GPU): lower its max_tokens_per_micro_batch "
                           "(or micro_batch_size) or give it a larger gpu_shares entry")
    return f"out of GPU memory ({said}); {plan}"
