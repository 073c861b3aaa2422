"""Meeting points of a process group between node actors: a TCPStore, and what each end
tells the others about its device (the weight push's group: sync.py; a multi-rank node's: multirank.py).
"""

from __future__ import annotations

from datetime import timedelta

import torch


def device_info(device: str, model: torch.nn.Module | None = None) -> dict:
    """What an end tells the others: {"device": "cuda" | "cpu", "uuid": its GPU's, or ""} (+ "dtype" of
    `model`'s weights)."""
    info = {"device": "cuda" if device.startswith("cuda") else "cpu", "uuid": ""}
    if info["device"] == "cuda":
        info["uuid"] = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    if model is not None:
        info["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    return info


def tcp_store(host: str, port: int, is_master: bool, timeout: timedelta):
    """The rendezvous TCPStore at host:port (is_master: hosted here); does not wait for the others.
    A host passes port 0 and publishes `store.port`: the OS picks a port as it binds, where a port
    picked ahead of time could be taken before it is bound."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, is_master, timeout, wait_for_workers=False)
