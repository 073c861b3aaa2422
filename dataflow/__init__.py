"""dataflow: RLHF pipelines as graphs of Ray actor nodes joined by bounded async channels."""

from dataflow.errors import ConfigError, GraphError, NodeFailed, UserError
from dataflow.graph import Graph
from dataflow.node import Node, NodeContext

__all__ = ["Graph", "Node", "NodeContext", "UserError", "GraphError", "ConfigError", "NodeFailed"]
