"""An out-of-memory error in a node's step, through the real runtime (Ray actors): the run ends with
one line naming the node, what torch asked and allowed, and the node's memory note (what the memory
plan gave it and the setting to lower; rl/model/applied_plan.apply writes it), as a user error
(exit 2 in the CLI), not a traceback. torch.OutOfMemoryError is raised by hand: there is no GPU here.
Also the GPU size the plan reads from nvidia-smi (a stand-in script on PATH)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import pytest
import torch

from dataflow import Graph, Node
from dataflow.driver.runtime import RunOptions, run_graph
from dataflow.errors import UserError

pytestmark = pytest.mark.usefixtures("ray_instance")

TORCH_TEXT = ("CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total capacity of 139.72 GiB of which "
              "60.12 GiB is free. Including non-PyTorch memory, this process has 27.96 GiB memory in use. "
              "27.96 GiB allowed; Of the allocated memory 25.10 GiB is allocated by PyTorch.\nSee documentation")


@dataclass(kw_only=True)
class StepConfig:
    steps_before: int = 1
    """Steps that succeed before the one that runs out of memory."""


class OutOfMemoryStep(Node):
    """Reports `steps_before` steps, then raises torch's out-of-memory error in the next one."""

    Config = StepConfig

    async def run(self):
        for i in range(self.config.steps_before):
            await self.ctx.step_done({"i": i})
        raise torch.OutOfMemoryError(TORCH_TEXT)


def test_an_out_of_memory_step_ends_the_run_in_one_line_with_the_plans_note(tmp_path):
    g = Graph("oom")
    g.node("learner", OutOfMemoryStep, StepConfig(), cpus=0.25, ends_run=True)
    note = "the memory plan gave it 0.20 of a 140 GiB GPU for 25.00 GiB (...); lower learner.max_tokens_per_micro_batch (now 4096)"
    g.nodes["learner"].memory_note = note
    g.validate()
    with pytest.raises(UserError) as caught:
        asyncio.run(run_graph(g, RunOptions(out_dir=str(tmp_path), quiet=True)))
    line = str(caught.value)
    assert line == f"node 'learner' (run): out of GPU memory (Tried to allocate 2.32 GiB; 27.96 GiB allowed; it held 25.10 GiB); {note}"


@pytest.mark.parametrize("answers,expected_mib", [
    ({"memory.total,memory.reserved": "81559, 480"}, 81559 - 480),   # an H100 80GB: torch counts the same
    ({"memory.total": "143771"}, 143771),                            # a driver without memory.reserved
])
def test_the_plans_gpu_size_is_what_cuda_counts_read_from_nvidia_smi(tmp_path, monkeypatch, answers, expected_mib):
    """graphs/rlhf.gpu_total_bytes: nvidia-smi's total less what its driver reserves, the total
    torch's per-process cap is a fraction of; the total alone where the field is unknown (nvidia-smi
    exits non-zero). A stand-in nvidia-smi on PATH answers each query as a driver would."""
    from graphs.rlhf import gpu_total_bytes

    script = tmp_path / "nvidia-smi"
    cases = "\n".join(f'  *"--query-gpu={q} "*) echo "{a}"; exit 0 ;;' for q, a in answers.items())
    script.write_text(f'#!/bin/sh\ncase "$*" in\n{cases}\n  *) echo "Field is not a valid field to query." >&2; exit 2 ;;\nesac\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert gpu_total_bytes() == expected_mib * (1 << 20)
