"""examples/smollm2_arithmetic/last_number_reward.py agrees with the held-out judge (examples/smollm2_arithmetic/heldout.answer_correct), and
refuses the restated question that math_reward accepts."""

import importlib.util
from pathlib import Path

from examples.smollm2_arithmetic.heldout import answer_correct

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("last_number_reward", ROOT / "examples" / "smollm2_arithmetic" / "last_number_reward.py")
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)

CASES = [("85", "85"), ("The answer is 85.", "85"), ("= 85", "85"), ("\\boxed{85}", "85"), ("47 + 38", "85"),
         ("47 + 38 = 85", "85"), ("85, not 86", "85"), ("1,085", "1085"), ("-3", "-3"), ("no number", "5"),
         ("12.50", "12.5"), ("", "0")]


def test_agrees_with_heldout_judge():
    for response, answer in CASES:
        assert _mod.last_number_reward(None, response, answer=answer) == float(answer_correct(response, answer)), response


def test_restated_question_scores_zero():
    assert _mod.last_number_reward(None, "47 + 38", answer="85") == 0.0
    assert _mod.last_number_reward(None, "47 + 38 = 85", answer="85") == 1.0
