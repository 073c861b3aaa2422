"""A reward for the arithmetic task that cannot be won by restating the question.

    python bench/real_rl.py ... --set reward.path=examples/smollm2_arithmetic/last_number_reward.py --set reward.function=last_number_reward

1.0 when the last number of the response equals the answer, else 0.0: the held-out judge of
examples/smollm2_arithmetic/heldout.py (answer_correct), as a training reward. Why: rl/reward/math_reward.py's math_reward asks
math-verify, which parses and evaluates expressions, so "47 + 38" scores 1.0 against the answer 85.
GRPO on SmolLM2-135M-Instruct found that quickly: a perfect training reward while held-out
last-number accuracy fell to nothing (bench/results/smollm2_grpo_ppo_h200_2026-12-01.md).
Self-contained (no project import), so a reward worker loads it by path wherever it runs.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")   # examples/smollm2_arithmetic/heldout.py's _NUMBER


def last_number_reward(prompt, response: str, answer=None, **fields) -> float:
    found = _NUMBER.findall(response)
    if not found or answer is None:
        return 0.0
    try:
        return 1.0 if float(found[-1].replace(",", "")) == float(answer) else 0.0
    except ValueError:
        return 0.0
