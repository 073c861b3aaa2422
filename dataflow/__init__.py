"""dataflow: RLHF pipelines as graphs of Ray actor nodes joined by bounded async channels."""

from dataflow.config import check, fill, share
from dataflow.errors import ConfigError, GraphError, NodeFailed, UserError
from dataflow.graph import Graph
from dataflow.node import Node, NodeContext
from dataflow.presets import auto_weight_transport
from dataflow.weights.edges import policy_edge

__all__ = ["Graph", "Node", "NodeContext", "UserError", "GraphError", "ConfigError", "NodeFailed",
           "share", "fill", "check", "auto_weight_transport", "policy_edge"]
