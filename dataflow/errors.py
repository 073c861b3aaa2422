"""Errors the CLI prints as one short message (no traceback): mistakes the user can fix."""


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
