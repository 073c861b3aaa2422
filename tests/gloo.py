"""Gloo worlds of forked test processes that meet without picking a port ahead.

Rank 0 listens on port 0 (the OS picks as it binds) and tells the others the port through a file in
the test's tmp dir: a port picked free ahead of time can be taken by another socket (gloo opens
many) before it is bound, which failed CI once.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist


def tell_port(tmp: str, key: str):
    """on_listen for the rank that hosts meeting point `key`: writes the port it got."""
    def tell(port: int):
        path = os.path.join(tmp, f"port-{key}")
        with open(path + ".part", "w") as f:
            f.write(str(port))
        os.replace(path + ".part", path)
    return tell


def told_port(tmp: str, key: str, timeout_s: float = 60) -> int:
    """The port of meeting point `key`, once its host wrote it."""
    path, deadline = os.path.join(tmp, f"port-{key}"), time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"no port for {key} within {timeout_s} s"
        time.sleep(0.01)
    with open(path) as f:
        return int(f.read())


def join_world(tmp: str, key: str, rank: int, size: int) -> None:
    """This process as rank `rank` of the default gloo process group `key` of `size` ranks."""
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        tell_port(tmp, key)(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", told_port(tmp, key), None, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
