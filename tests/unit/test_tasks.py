"""rl/data/tasks.py: the default task needs the prompt, determinism, tokenizer. (Datasets: tests/unit/test_data.py.)"""

import itertools
import random
from collections import Counter

import pytest

from rl.data import tasks

ALL_TASKS = [(name, k) for name in tasks.TASK_NAMES for k in (2, 3)]


def best_constant_score(records):
    """Best mean score of one fixed response over `records` (exact for per-position credit).

    Per-position credit is a sum over positions, so the best constant picks, at each position,
    the answer token that is most frequent there; exact-match tasks pick the most frequent answer.
    """
    answers = [r["answer"].split() for r in records]
    if records[0]["task"] == "first_digit":
        return Counter(map(tuple, answers)).most_common(1)[0][1] / len(records)
    k = len(answers[0])
    return sum(Counter(a[i] for a in answers).most_common(1)[0][1] for i in range(k)) / k / len(records)


def random_policy_score(task, records, tokenizer, seed=0):
    """Mean score of a policy that samples uniformly over the vocab (bar <pad>, <bos>)."""
    rng = random.Random(seed)
    choices = [t for t in tokenizer.get_vocab() if t not in (tasks.PAD, tasks.BOS)]
    total = 0.0
    for r in records:
        response = []
        for _ in range(task.max_new_tokens):
            tok = rng.choice(choices)
            response.append(tok)
            if tok == tasks.EOS:
                break
        text = tokenizer.convert_tokens_to_string(response)
        text = " ".join(t for t in text.split() if t not in tasks.SPECIAL_TOKENS)
        total += task.score(r, text)
    return total / len(records)


def test_default_task_needs_the_prompt():
    task = tasks.make_task()
    assert (task.name, task.num_digits) == (tasks.DEFAULT_TASK, tasks.DEFAULT_NUM_DIGITS)
    records = task.take(2000)
    assert best_constant_score(records) <= 0.3
    assert random_policy_score(task, records[:500], tasks.build_tokenizer()) < 0.2
    assert task.score(records[0], records[0]["answer"]) == 1.0


@pytest.mark.parametrize("name,k", ALL_TASKS)
def test_every_task_constant_and_random_bounds(name, k):
    task = tasks.make_task(name, k, seed=3)
    records = task.take(1000)
    assert best_constant_score(records) <= 0.3
    assert random_policy_score(task, records[:300], tasks.build_tokenizer()) < 0.2
    for r in records[:20]:
        assert task.score(r, r["answer"]) == 1.0


def test_best_constant_formula_matches_brute_force():
    records = tasks.make_task("reverse", 2, seed=1).take(200)
    digits = [str(d) for d in range(10)]
    candidates = [" ".join(c) for n in range(4) for c in itertools.product(digits, repeat=n)]
    brute = max(sum(tasks.score(r, c) for r in records) / len(records) for c in candidates)
    assert brute == pytest.approx(best_constant_score(records))


def test_prompts_are_deterministic_by_seed():
    a = tasks.make_task("copy", 3, seed=7).take(50)
    assert a == tasks.make_task("copy", 3, seed=7).take(50)
    assert a != tasks.make_task("copy", 3, seed=8).take(50)
    task = tasks.make_task("copy", 3, seed=7)
    assert list(itertools.islice(task.prompts(), 5)) == list(itertools.islice(task.prompts(), 5))
    assert a[0].keys() == {"prompt", "answer", "task"}


def test_scores_and_token_rewards():
    rec = {"prompt": "reverse 1 2 3 :", "answer": "3 2 1", "task": "reverse"}
    assert tasks.score(rec, "3 2 1") == 1.0
    assert tasks.score(rec, "3 0 1") == pytest.approx(2 / 3)
    assert tasks.score(rec, "3 2 1 9 9") == 1.0        # tokens after the k-th are ignored
    assert tasks.score(rec, "2 1") == 0.0              # no shifting
    assert tasks.score(rec, "") == 0.0
    toks = ["3", "0", "1", "<eos>"]
    rewards = tasks.token_rewards(rec, toks)
    assert rewards == pytest.approx([1 / 3, 0.0, 1 / 3, 0.0])
    assert sum(rewards) == pytest.approx(tasks.score(rec, "3 0 1"))
    first = {"prompt": "first 4 5 :", "answer": "4", "task": "first_digit"}
    assert tasks.score(first, "4") == 1.0 and tasks.score(first, "4 4") == 0.0
    assert tasks.token_rewards(first, ["4", "<eos>"]) == [0.0, 1.0]
    with pytest.raises(ValueError, match="unknown task"):
        tasks.make_task("nope", 3)


def test_tokenizer_round_trip_and_save_load(tmp_path):
    tok = tasks.build_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    for r in tasks.make_task("sort", 4).take(20):
        ids = tok(r["prompt"])["input_ids"]
        assert ids[0] == tok.bos_token_id and len(ids) == 1 + 4 + 2
        assert tok.decode(ids, skip_special_tokens=True) == r["prompt"]
        answer_ids = tok(r["answer"], add_special_tokens=False)["input_ids"]
        assert tok.decode(answer_ids + [tok.eos_token_id], skip_special_tokens=True) == r["answer"]
    assert tok("copy 314:")["input_ids"] == tok("copy 3 1 4 :")["input_ids"]
    assert tok.convert_tokens_to_ids("<unk>") in tok("copy x")["input_ids"]
    tok.save_pretrained(tmp_path)
    loaded = tasks.load_tokenizer(str(tmp_path))
    assert loaded("reverse 9 0 :")["input_ids"] == tok("reverse 9 0 :")["input_ids"]
    assert (loaded.pad_token_id, loaded.eos_token_id, len(loaded)) == (0, 2, len(tok))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        tasks.load_tokenizer(str(tmp_path / "missing"))
