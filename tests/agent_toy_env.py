"""Toy environments for the multi-turn tests (tests/integration/test_agent_graph.py, bench/agent_learns.py),
written as a user writes an env file (docs/agents.md): gym-style classes, one instance per episode.

CopyDigits: three turns; each observation asks for a digit ("copy 4"); a turn whose answer starts
with that digit earns 1/3. A random tiny model starts near 1/10 per turn and can learn it: the digit
to copy is the last token before the generation prompt.
"""

import os
import time


class CopyDigits:
    def reset(self, prompt, target="123", **row):
        self.targets, self.turn = list(target), 0
        self.log = []
        return prompt                        # "copy 1": the first user message

    def step(self, action):
        want = self.targets[self.turn]
        self.turn += 1
        self.log.append(action)
        reward = 1 / len(self.targets) if action.strip()[:1] == want else 0.0
        done = self.turn >= len(self.targets)
        return ("" if done else f"copy {self.targets[self.turn]}"), reward, done


class SlowCopyDigits(CopyDigits):
    """CopyDigits whose step takes `delay_s` (sync: it holds a thread of the env pool)."""

    def __init__(self, delay_s=0.2):
        self.delay_s = delay_s

    def step(self, action):
        time.sleep(self.delay_s)
        return super().step(action)


class FailsOnSecondTurn(CopyDigits):
    """Raises in its second step when the row says so (fail=1): that episode fails. Each step
    takes delay_s (env.kwargs), so a generator killed mid-run holds episodes mid-way. A row's
    `hold` names a file: while it exists, that episode's steps wait (a test holds a batch back)."""

    def __init__(self, delay_s=0.0):
        self.delay_s = delay_s

    def reset(self, prompt, target="123", fail=0, hold=None, **row):
        self.fail, self.hold = fail, hold
        return super().reset(prompt, target)

    def step(self, action):
        time.sleep(self.delay_s)
        while self.hold and os.path.exists(self.hold):
            time.sleep(0.05)
        if self.fail and self.turn == 1:
            raise RuntimeError("the toy environment broke")
        return super().step(action)
