"""Training rewards. The calculator task (reward.path=examples/agents/rewards.py,
reward.function=calculator_reward): 1.0 when the final answer is the product, else 0.0.

On agent runs the reward node calls it with the episode's final assistant message as `response`
(graphs/agent.py, env.reward=function or sum). An answer that still holds a tool call is no answer
(the episode ran out of turns mid-call). The format bonus is the environment's part
(calculator.CalculatorEnv.get_reward, env.reward=sum). The held-out judge (judge.py) is separate.
"""

import re

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def calculator_reward(prompt, response: str, answer: str, **fields) -> float:
    if "<tool_call>" in response:
        return 0.0
    found = _NUMBER.findall(response)
    if not found:
        return 0.0
    return 1.0 if float(found[-1].replace(",", "")) == float(answer) else 0.0


def one_guess_reward(prompt, response: str, secret, **fields) -> float:
    """The guessing game's single-turn baseline (data/guess_one_shot): 1.0 when the one guess (the
    first whole number, as guess_env reads it) is the secret."""
    found = re.search(r"-?\d+", response)
    return 1.0 if found and int(found.group()) == int(secret) else 0.0
