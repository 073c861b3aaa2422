"""A gym-style environment whose every step takes a fixed time, for bench/agent_overlap.py.

    --set env.path=bench/latency_env.py --set 'env.kwargs={"latency_s": 1.0, "turns": 3}'

Each episode lasts `turns` model turns; every step sleeps `latency_s` (sync: it holds a thread of
the generator's env pool, as a blocking tool or a remote call does) and asks for the next digit.
The reward (1 per turn whose answer starts with the asked digit, over the turns) only keeps GRPO's
groups from being all equal; the benchmark measures time, not learning.
"""

import time


class LatencyEnv:
    def __init__(self, latency_s: float = 0.0, turns: int = 3):
        self.latency_s, self.turns = float(latency_s), int(turns)

    def reset(self, prompt, target="123", **row):
        self.target, self.turn, self.score = str(target), 0, 0.0
        return prompt

    def step(self, action: str):
        time.sleep(self.latency_s)
        want = self.target[self.turn % len(self.target)]
        self.turn += 1
        reward = (1.0 / self.turns) if action.strip()[:1] == want else 0.0
        done = self.turn >= self.turns
        return ("" if done else f"copy {self.target[self.turn % len(self.target)]}"), reward, done
