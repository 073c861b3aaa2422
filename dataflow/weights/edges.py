"""The versioned edges the learner's weights travel on, declared by a graph in one line.

    policy_edge(g, src="learner", dst=["generator", "prompts"], transport=cfg.weight_transport)

declares `policy` (learner -> dst; object_store / cuda_ipc: the weights or their handles,
collective: only the version) and, with transport="collective", the push group's rendezvous
edge `policy_sync` (SYNC_EDGE) from the learner to the nodes of dst that subscribe to it (the
generators; dataflow/weights/sync.py has the rendezvous). No torch here: graph files import it.
"""

from __future__ import annotations

SYNC_EDGE = "policy_sync"
"""Versioned edge (learner -> generators) carrying the collective transport's rendezvous address."""


def policy_edge(g, *, src: str, dst: list[str], transport: str) -> str:
    """Declare the weight edge `policy` from `src` to `dst` (told in the order listed: put the
    generators before the prompt source, so it never admits a batch before they hold its weights)
    and, with transport="collective", SYNC_EDGE to the nodes of `dst` whose kind subscribes to it."""
    g.versioned("policy", src=src, dst=dst)
    if transport == "collective":
        receivers = [d for d in dst if d in g.nodes and SYNC_EDGE in getattr(g.nodes[d].kind, "subscribes", ())]
        g.versioned(SYNC_EDGE, src=src, dst=receivers)
    return "policy"
