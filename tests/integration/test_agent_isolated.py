"""env.isolate=true: a gym-style environment in its own process, killed when it hangs (starts
worker processes, so it lives in the integration tier; the rest of rl/agent's tests are in
tests/unit/test_agent_env.py)."""

from __future__ import annotations

import time

import pytest

from rl.agent import EnvConfig, EnvLoadError, load_environment
from tests.chat_model import chat_tokenizer
from tests.unit.test_agent_env import play, run, write

ISOLATED = """
import os, time
class Proc:
    def __init__(self, hang_at=0):
        self.hang_at, self.turn = hang_at, 0
    async def reset(self, **row):
        return f"add {os.getpid()}"
    def step(self, action):
        self.turn += 1
        if self.turn == self.hang_at:
            time.sleep(600)
        if action == "copy":
            raise ValueError("boom")
        return "copy", float(self.turn), False
"""


def test_isolated_env_runs_in_its_own_process_and_is_killed_when_it_hangs(tmp_path):
    import os
    tok = chat_tokenizer()
    path = write(tmp_path, ISOLATED)
    ep, _ = run(play(load_environment(EnvConfig(path=path, isolate=True), tok), {"prompt": "x"}, ["1", "2", "copy"], tok))
    r = ep.result()
    pid = int(r.messages[0]["content"].split()[1])
    assert pid != os.getpid() and r.step_rewards == [1.0, 2.0] and r.turns == 3     # state kept across turns
    assert r.failed == "step raised ValueError: boom"
    factory = load_environment(EnvConfig(path=path, isolate=True, step_timeout_s=1.0, kwargs={"hang_at": 1}), tok)
    ep, _ = run(play(factory, {"prompt": "x"}, ["1"], tok))
    assert ep.result().failed == "step timed out after 1 s"
    pid = int(ep.messages[0]["content"].split()[1])
    with pytest.raises(ProcessLookupError):           # killed, not left hanging
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.1)
    with pytest.raises(EnvLoadError, match="env.isolate=true runs a gym-style class"):
        load_environment(EnvConfig(path=write(tmp_path, TOOLS_FOR_ISOLATE, "t.py"), tools=["f"], reward="function",
                                   isolate=True), tok)


TOOLS_FOR_ISOLATE = '''
def f(x: int) -> int:
    """Id.

    Args:
        x: a number
    """
    return x
'''
