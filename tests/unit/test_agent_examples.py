"""examples/agents/: the two tasks' files as users write them, loaded by rl/agent, their data, the
training rewards and the held-out judge's success rule (issue 36, item 6). No model: the tokenizer
is tests/agent_tokenizers.py's BPE with tests/chat_model.py's ChatML template (no tools section,
SmolLM2's case)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "agents"))
sys.path.insert(0, str(ROOT / "bench"))

import calculator as C  # noqa: E402
import guess_env as G  # noqa: E402
import judge as J  # noqa: E402
import rewards as R  # noqa: E402
import tasks as T  # noqa: E402
from tests.agent_tokenizers import bpe_tokenizer  # noqa: E402
from tests.chat_model import CHATML  # noqa: E402


def test_calculator_evaluates_and_refuses():
    assert C.calculator("347 * 68") == "23596"
    assert C.calculator("347 x 68 =") == "23596"
    assert C.calculator("(10 - 4) / 4") == "1.5"
    for bad in ("__import__('os')", "347 ** 68", "", "two * 3"):
        with pytest.raises(ValueError):
            C.calculator(bad)
    env = C.CalculatorEnv()
    env.reset(prompt="x", answer="1")
    assert env.get_reward() == 0.0
    with pytest.raises(ValueError):
        env.calculator("nope")
    assert env.get_reward() == 0.0
    assert env.calculator("2 * 3") == "6" and env.get_reward() == C.FORMAT_BONUS


def test_guessing_game_answers_and_ends():
    game = G.GuessingGame(max_guesses=3)
    assert "between 1 and 100" in game.reset(secret=40, prompt="ignored")
    assert game.step("I guess 50.")[:3] == ("Lower. 2 guesses left.", 0.0, False)
    assert game.step("no idea")[:3] == ("Answer with only a whole number between 1 and 100. 1 guesses left.", 0.0, False)
    assert game.step("40")[1:3] == (1.0, True)
    game.reset(secret=7)
    game.step("1"), game.step("2")
    obs, reward, done, info = game.step("3")
    assert (reward, done, info["won"]) == (0.0, True, False) and "7" in obs


def test_guessing_game_bonus_pays_each_guess_the_answers_still_allowed():
    game = G.GuessingGame(max_guesses=5, consistent_bonus=0.1)
    game.reset(secret=40)
    assert game.step("50")[1] == 0.1          # 1..100 allowed it; now 1..49
    assert game.step("60")[1] == 0.0          # "Lower." was said after 50
    assert game.step("30")[1] == 0.1          # inside 1..49; now 31..49
    assert game.step("no number")[1] == 0.0
    obs, reward, done, _ = game.step("45")    # the last guess: allowed, wrong, the game ends
    assert (reward, done) == (0.1, True) and "40" in obs
    game.reset(secret=7)
    assert game.step("7")[1:3] == (1.0, True)  # a win pays 1.0, no bonus on top


def test_task_data_is_deterministic_and_splits_do_not_overlap(tmp_path):
    a, b = T.write_all(str(tmp_path / "a"), num_val=50, num_train=200), T.write_all(str(tmp_path / "b"), num_val=50, num_train=200)
    for name in a:
        for x, y in zip(a[name], b[name]):
            assert Path(x).read_bytes() == Path(y).read_bytes()
    train, val = (J.read_rows(p) for p in a["calculator"])
    question = lambda r: r["prompt"][-1]["content"]  # noqa: E731
    assert not {question(r) for r in train} & {question(r) for r in val}
    row = val[0]
    x, y = (int(n) for n in question(row).removeprefix("What is ").rstrip("?").split(" * "))
    assert 100 <= x <= 999 and 10 <= y <= 99 and row["answer"] == str(x * y)
    assert row["prompt"][0]["role"] == "system" and "<tool_call>" in row["prompt"][0]["content"]
    assert [m["role"] for m in row["prompt"]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert "<tool_call>" in row["prompt"][2]["content"] and "5535" in row["prompt"][3]["content"]
    no_tool = J.read_rows(a["calculator_no_tool"][1])[0]
    assert len(no_tool["prompt"]) == 1 and "tool" not in no_tool["prompt"][0]["content"]
    guess = J.read_rows(a["guess"][1])[0]
    assert guess["prompt"][0]["content"] == G.GuessingGame().reset(secret=guess["secret"])


def test_rewards_and_judge_agree_on_answers_and_differ_where_they_should():
    assert R.calculator_reward("", "347 * 68 = 23,596", "23596") == 1.0
    assert R.calculator_reward("", '<tool_call>{"name": "calculator"}</tool_call> 23596', "23596") == 0.0
    assert R.one_guess_reward("", "My guess is 42, or 43", secret=42) == 1.0
    row = {"answer": "23596", "secret": 42}
    chat = [{"role": "user", "content": "What is 347 * 68?"}, {"role": "assistant", "content": "<tool_call>...</tool_call>"},
            {"role": "user", "content": "<tool_response>\n23596\n</tool_response>"}]
    assert not J.success("calculator", chat, row)              # ended on the tool's result: no answer
    assert J.success("calculator", chat + [{"role": "assistant", "content": "It is 23596."}], row)
    game = [{"role": "assistant", "content": "50"}, {"role": "user", "content": "Lower."},
            {"role": "assistant", "content": "42 I think"}]
    assert J.success("guess", game, row) and not J.success("guess", game[:2], row)


@pytest.mark.parametrize("task", sorted(J.TASKS))
def test_task_files_load_and_play_through_rl_agent(task, tmp_path):
    """The judge's settings (what graphs/agent.py runs) load every task file, and an episode with
    hand-written turns renders the tool listing, runs the tool or game, and ends as the judge reads."""
    from rl.agent.config import EnvConfig
    from rl.agent.loading import load_environment
    tok = bpe_tokenizer(CHATML)
    paths = T.write_all(str(tmp_path), num_val=4, num_train=4)
    row = J.read_rows(paths[task][1])[0]
    factory = load_environment(EnvConfig(**J.TASKS[task]), tok)
    if task == "calculator":
        a, b = row["prompt"][-1]["content"].removeprefix("What is ").rstrip("?").split(" * ")
        turns = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s * %s"}}\n</tool_call>' % (a, b),
                 f"The answer is {row['answer']}."]
    else:
        turns = ["50", str(row["secret"])] if row["secret"] != 50 else ["50"]

    async def play():
        ep = factory.episode(row)
        prompt = tok.decode(await ep.start())
        for text in turns:
            turn = await ep.step(tok.encode(text, add_special_tokens=False), False)
        return prompt, turn, ep.result()

    try:
        prompt, last, result = asyncio.run(play())
    finally:
        factory.close()
    assert last.done and result.failed is None
    if task == "calculator":
        assert '"name": "calculator"' in prompt and "<tools>" in prompt    # listed in the system prompt
        assert any(row["answer"] in m["content"] for m in result.messages if m["role"] == "user")   # the tool's result
        assert result.counters["tool_calls"] == 1 and result.counters["tool_errors"] == 0
    else:
        assert result.reward == 1.0
    assert J.success(task, result.messages, row)


def test_trl_chat_template_writes_tool_results_as_rl_agent_does():
    """bench/real_trl_agent.py gives TRL a template whose tool message renders exactly as rl/agent's
    user turn of <tool_response> for a template without tools, so both engines train on one text."""
    from real_trl_agent import CHAT_TEMPLATE
    from rl.agent import tools as RT
    tok = bpe_tokenizer(CHATML)
    head = [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 2 * 3?"},
            {"role": "assistant", "content": "<tool_call>x</tool_call>"}]
    ours = tok.apply_chat_template(head + RT.result_messages([("calculator", "6")], in_template=False),
                                   tokenize=False, add_generation_prompt=True)
    trl = tok.apply_chat_template(head + [{"role": "tool", "name": "calculator", "content": "6"}],
                                  chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert trl == ours
