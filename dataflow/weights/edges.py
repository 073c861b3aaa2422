"""The versioned edges the learner's weights travel on, declared by a graph in one line.

    policy_edge(g, src="learner", dst=["generator", "prompts"], transport=cfg.weight_transport)

declares `policy` (learner -> dst; object_store / cuda_ipc: the weights or their handles,
collective: only the version) and, with transport="collective", the push group's rendezvous
edge `policy_sync` (SYNC_EDGE) from the learner to the nodes of dst that subscribe to it (the
generators; dataflow/weights/sync.py has the rendezvous). No torch here: graph files import it,
and the node declarations (nodes/learner.py, generator.py, critic.py) the edge names and the
transport's settings (WeightSyncConfig), which dataflow/weights/sync.py and multirank.py use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from dataflow.checks import Positive

SYNC_EDGE = "policy_sync"
"""Versioned edge (learner -> generators) carrying the collective transport's rendezvous address."""
RANKS_EDGE = "ranks"
"""Versioned edge (the learner -> itself) carrying its replica 0's rendezvous address
(dataflow/weights/multirank.py)."""
CRITIC_RANKS_EDGE = "critic_ranks"
"""The same for the critic (edge names are global to a graph)."""


@dataclass(kw_only=True)
class WeightSyncConfig:
    transport: Literal["object_store", "collective", "cuda_ipc"] = "object_store"
    """object_store: state dict through Ray's object store. collective: HybridEngine push
    (gloo/NCCL broadcast from the learner; any model family: the model's own names). cuda_ipc: learner and every
    generator on one physical GPU share the weights through CUDA IPC buffers (no copy through the
    CPU; see the module docstring)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """object_store and cuda_ipc (the learner's setting counts): the dtype the learner's weights
    travel in; match the generators' dtype, which the graph files fill in (graphs/ppo.py). auto:
    object_store sends the learner's own dtype, cuda_ipc bfloat16. collective asks the generators."""
    backend: Literal["auto", "gloo"] = "auto"
    """collective: auto = NCCL when every end has a CUDA device of its own, else gloo."""
    timeout_s: Annotated[float, Positive] = 120.0
    """collective: a push, or a generator's wait for a version, that takes longer fails naming both ends.
    cuda_ipc: a generator's wait for a version it has not staged yet."""
    rendezvous_timeout_s: Annotated[float, Positive] = 600.0
    """collective: how long the learner and the generators wait for each other in their setups
    (which include loading the models)."""
    checksums: bool = False
    """Log a checksum of the weights per version (learner: pushed; generator: switched to)."""


def policy_edge(g, *, src: str, dst: list[str], transport: str) -> str:
    """Declare the weight edge `policy` from `src` to `dst` (told in the order listed: put the
    generators before the prompt source, so it never admits a batch before they hold its weights)
    and, with transport="collective", SYNC_EDGE to the nodes of `dst` whose kind subscribes to it."""
    g.versioned("policy", src=src, dst=dst)
    if transport == "collective":
        receivers = [d for d in dst if d in g.nodes and SYNC_EDGE in getattr(g.nodes[d].kind, "subscribes", ())]
        g.versioned(SYNC_EDGE, src=src, dst=receivers)
    return "policy"
