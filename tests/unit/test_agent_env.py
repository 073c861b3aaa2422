"""rl/agent: gym-style environments run turn by turn (pure library, no Ray).

Trajectories are checked token by token against a full render of the final chat by the chat
template (the tiny chat model's word-level ChatML, a byte-level BPE with a Qwen2.5-like template;
SmolLM2's real tokenizer: tests/test_agent_smollm2.py); masks against the hand-built layout; limits,
timeouts, failures and bad files each end with one line.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time

import pytest

from rl.agent import EnvConfig, EnvLoadError, load_environment
from tests.agent_tokenizers import THINK_DROPPING, bpe_tokenizer
from tests.chat_model import IM_END, chat_tokenizer

GUESS_ENV = """
class Guess:
    '''Guess the number: 'higher' / 'lower' until right; reward 1 when right.'''
    def __init__(self, secret=7, feedback="Incorrect. Try again."):
        self.secret, self.feedback, self.closed = secret, feedback, False
    def reset(self, prompt, **row):
        return prompt
    def step(self, action):
        right = action.strip().endswith(str(self.secret))
        return (self.feedback, 1.0 if right else 0.0, right)
    def close(self):
        self.closed = True
"""


def write(tmp_path, source: str, name: str = "env.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def run(coro):
    return asyncio.run(coro)


def full_render(tok, messages, **kwargs) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs),
                      add_special_tokens=False)


async def play(factory, row, replies, tok, end_token=IM_END):
    """Runs an episode with `replies` as the model's turns (encoded, + end_token when not None);
    returns (episode, the turns)."""
    ep = factory.episode(row)
    assert await ep.start(), ep.failed
    turns = []
    for reply in replies:
        ids = tok.encode(reply, add_special_tokens=False)
        ids += [tok.convert_tokens_to_ids(end_token)] if end_token else []
        turn = await ep.step(ids, finished=end_token is not None)
        turns.append(turn)
        if turn.done:
            break
    return ep, turns


@pytest.mark.parametrize("make_tok", [chat_tokenizer, bpe_tokenizer], ids=["tiny-chatml", "bpe-qwen-like"])
def test_trajectory_equals_a_full_render_token_for_token(tmp_path, make_tok):
    tok = make_tok()
    factory = load_environment(EnvConfig(path=write(tmp_path, GUESS_ENV), kwargs={"secret": 3, "feedback": "add 1"}), tok)
    ep, turns = run(play(factory, {"prompt": "add 1 + 2"}, ["4", "= 3"], tok))
    r = ep.result()
    assert r.failed is None and r.ended_by == "done" and r.turns == 2 and r.step_rewards == [0.0, 1.0]
    assert r.reward == 1.0
    # Hand-built: prompt, sampled turn 1 (+ <|im_end|>), the observation's render, sampled turn 2.
    t1 = tok.encode("4", add_special_tokens=False) + [tok.convert_tokens_to_ids(IM_END)]
    t2 = tok.encode("= 3", add_special_tokens=False) + [tok.convert_tokens_to_ids(IM_END)]
    env = turns[0].append_ids
    assert r.response_ids == t1 + env + t2
    assert r.loss_mask == [1] * len(t1) + [0] * len(env) + [1] * len(t2)
    assert r.messages == [{"role": "user", "content": "add 1 + 2"}, {"role": "assistant", "content": "4"},
                          {"role": "user", "content": "add 1"}, {"role": "assistant", "content": "= 3"}]
    # The whole sequence is the template's render of the chat (turn 2 then ends at its <|im_end|>).
    whole = full_render(tok, r.messages[:3])
    assert r.prompt_ids + r.response_ids[:len(t1) + len(env)] == whole
    assert r.prompt_ids == full_render(tok, r.messages[:1])
    if make_tok is bpe_tokenizer:          # (word-level decoding joins words with spaces)
        assert tok.decode(r.prompt_ids + r.response_ids) == tok.apply_chat_template(r.messages, tokenize=False)[:-1]


def test_a_turn_ending_on_another_stop_token_gets_the_templates_end_of_turn(tmp_path):
    """The tiny model's generation config also stops on <|endoftext|>, which the template never
    writes: it stays (sampled), and the environment adds <|im_end|>."""
    tok = chat_tokenizer()
    factory = load_environment(EnvConfig(path=write(tmp_path, GUESS_ENV), kwargs={"feedback": "add 1"}), tok)
    ep, turns = run(play(factory, {"prompt": "add 1"}, ["4"], tok, end_token="<|endoftext|>"))
    assert tok.convert_ids_to_tokens(turns[0].append_ids) == ["<|im_end|>", "<|im_start|>", "user", "add", "1",
                                                              "<|im_end|>", "<|im_start|>", "assistant"]
    assert ep.messages[1] == {"role": "assistant", "content": "4"}


def test_template_that_is_not_append_only_keeps_history_or_fails(tmp_path):
    tok = bpe_tokenizer(THINK_DROPPING)
    path = write(tmp_path, GUESS_ENV)
    reply = "<think>let me think</think> 5"
    ep, turns = run(play(load_environment(EnvConfig(path=path), tok), {"prompt": "guess"}, [reply, "7"], tok))
    r = ep.result()
    assert r.ended_by == "done" and r.counters["non_append_renders"] == 1
    # Kept as sampled: the <think> block stays in the tokens; the observation is rendered alone.
    assert tok.encode(reply, add_special_tokens=False) == r.response_ids[:len(tok.encode(reply, add_special_tokens=False))]
    alone = tok.encode("\n<|im_start|>user\nIncorrect. Try again.<|im_end|>\n<|im_start|>assistant\n",
                       add_special_tokens=False)
    assert turns[0].append_ids == alone
    ep, _ = run(play(load_environment(EnvConfig(path=path, non_append_template="error"), tok),
                     {"prompt": "guess"}, [reply], tok))
    assert ep.result().ended_by == "failed" and "not append-only" in ep.failed and "\n" not in ep.failed


def test_async_env_and_dict_and_gymnasium_results(tmp_path):
    tok = chat_tokenizer()
    path = write(tmp_path, """
        class A:
            async def reset(self, **row):
                return [{"role": "system", "content": "you are terse"}, {"role": "user", "content": row["prompt"]}]
            async def step(self, action):
                return {"observation": "copy", "reward": 0.5, "done": action == "1"}
        class B:
            def reset(self, **row):
                return {"role": "user", "content": "add 1"}
            def step(self, action):
                return "copy", 1, False, action == "2", {}
        """)
    ep, _ = run(play(load_environment(EnvConfig(path=path, name="A"), tok), {"prompt": "add"}, ["2", "1"], tok))
    assert ep.result().step_rewards == [0.5, 0.5] and ep.result().reward == 1.0
    assert ep.messages[0]["role"] == "system" and ep.result().first_messages == 2
    ep, _ = run(play(load_environment(EnvConfig(path=path, name="B"), tok), {"prompt": "add"}, ["1", "2"], tok))
    assert ep.result().ended_by == "done" and ep.result().reward == 2.0


ENDLESS = """
import time
class Endless:
    def __init__(self, sleep_s=0.0, obs="copy 1 2 3 4 5 6 7 8 9"):
        self.sleep_s, self.obs = sleep_s, obs
    def reset(self, **row):
        return "add"
    def step(self, action):
        time.sleep(self.sleep_s)
        return self.obs, 0.0, False
"""


def test_limits_turns_episode_tokens_observation_tokens(tmp_path):
    tok = chat_tokenizer()
    path = write(tmp_path, ENDLESS)
    ep, turns = run(play(load_environment(EnvConfig(path=path, max_turns=3), tok), {"prompt": "x"}, ["1"] * 5, tok))
    r = ep.result()
    assert (r.ended_by, r.turns, len(r.step_rewards), r.failed) == ("max_turns", 3, 3, None)
    # 2 sampled + 15 environment tokens per turn (5 of the template, 10 of the text): a third
    # observation would bring the episode from 19 to 34 tokens.
    factory = load_environment(EnvConfig(path=path, max_episode_tokens=32), tok)
    ep, turns = run(play(factory, {"prompt": "x"}, ["1"] * 5, tok))
    r = ep.result()
    assert [len(t.append_ids) for t in turns] == [15, 0] and turns[1].done
    assert r.ended_by == "max_episode_tokens" and r.turns == 2 and len(r.response_ids) == 19
    ep = factory.episode({"prompt": "x"})
    run(ep.start())
    assert ep.turn_token_limit(8) == 8 and EnvConfig().max_turn_tokens == 0
    assert load_environment(EnvConfig(path=path, max_turn_tokens=5), tok).episode({}).turn_token_limit(8) == 5
    # An observation over the limit is cut in its content; the template's tokens stay.
    ep, turns = run(play(load_environment(EnvConfig(path=path, max_observation_tokens=9), tok),
                         {"prompt": "x"}, ["1", "2"], tok))
    ids = turns[0].append_ids
    assert len(ids) == 9 and ep.result().counters["truncated_observations"] == 2
    assert tok.convert_ids_to_tokens(ids) == ["<|im_start|>", "user", "copy", "1", "2", "3", "<|im_end|>",
                                              "<|im_start|>", "assistant"]
    assert ep.messages[2]["content"] == "copy 1 2 3"


def test_step_timeout_and_episode_timeout_fail_the_episode(tmp_path):
    tok = chat_tokenizer()
    path = write(tmp_path, ENDLESS)
    factory = load_environment(EnvConfig(path=path, kwargs={"sleep_s": 5.0}, step_timeout_s=0.2), tok)
    start = time.monotonic()
    ep, turns = run(play(factory, {"prompt": "x"}, ["1"], tok))
    assert time.monotonic() - start < 4.0 and turns[0].done and turns[0].append_ids == []
    assert ep.result().failed == "step timed out after 0.2 s" and ep.result().ended_by == "failed"
    factory = load_environment(EnvConfig(path=path, kwargs={"sleep_s": 0.15}, episode_timeout_s=0.4), tok)
    ep, turns = run(play(factory, {"prompt": "x"}, ["1"] * 4, tok))
    assert ep.result().failed.startswith("episode timed out: the environment took over 0.4 s")
    assert 2 <= ep.result().turns <= 3


def test_async_step_timeout(tmp_path):
    tok = chat_tokenizer()
    path = write(tmp_path, """
        import asyncio
        class Slow:
            def reset(self, **row):
                return "add"
            async def step(self, action):
                await asyncio.sleep(30)
        """)
    ep, _ = run(play(load_environment(EnvConfig(path=path, step_timeout_s=0.1), tok), {"prompt": "x"}, ["1"], tok))
    assert ep.result().failed == "step timed out after 0.1 s"


def test_sync_steps_run_off_the_event_loop(tmp_path):
    """While one episode's step blocks in its thread, another coroutine keeps running."""
    tok = chat_tokenizer()
    path = write(tmp_path, """
        import threading
        GATE = threading.Event()
        class Blocking:
            def reset(self, **row):
                return "add"
            def step(self, action):
                assert GATE.wait(10), "never released"
                return "copy", 1.0, True
        """)
    factory = load_environment(EnvConfig(path=path), tok)
    async def main():
        ep = factory.episode({"prompt": "x"})
        await ep.start()
        gate = sys.modules[type(ep.session.env).__module__].GATE
        stepping = asyncio.create_task(ep.step(tok.encode("1", add_special_tokens=False), True))
        ticks = 0
        while ticks < 20:                    # the loop runs while the step waits in its thread
            await asyncio.sleep(0.01)
            ticks += 1
        assert not stepping.done()
        gate.set()
        return await stepping, ticks
    turn, ticks = run(main())
    assert turn.done and ticks == 20


@pytest.mark.parametrize("body, reason", [
    ("def step(self, action):\n        raise ValueError('boom\\nsecond line')", "step raised ValueError: boom"),
    ("def step(self, action):\n        return 'just text'", "step returned str 'just text'; return (observation"),
    ("def step(self, action):\n        return ('obs', 1.0)", "step returned tuple"),
    ("def step(self, action):\n        return ('obs', 'high', False)", "step returned the reward 'high'"),
    ("def step(self, action):\n        return ('obs', float('nan'), False)", "step returned the reward nan"),
    ("def step(self, action):\n        return ('obs', 1.0, 'yes')", "step returned done='yes'"),
    ("def step(self, action):\n        return (5, 1.0, False)", "step returned int 5 as the observation"),
    ("def step(self, action):\n        return {'obs': 1}", "step returned a dict with keys ['obs']"),
])
def test_env_that_raises_or_returns_garbage_fails_the_episode_in_one_line(tmp_path, body, reason):
    tok = chat_tokenizer()
    path = write(tmp_path, f"class E:\n    def reset(self, **row):\n        return 'add'\n    {body}\n")
    ep, turns = run(play(load_environment(EnvConfig(path=path), tok), {"prompt": "x"}, ["1"], tok))
    r = ep.result()
    assert turns[0].done and r.ended_by == "failed" and r.failed.startswith(reason) and "\n" not in r.failed


def test_reset_and_constructor_failures_and_close_errors(tmp_path):
    tok = chat_tokenizer()
    path = write(tmp_path, """
        class BadInit:
            def __init__(self):
                raise RuntimeError("no sandbox")
            def reset(self, **row): ...
            def step(self, action): ...
        class BadReset:
            def reset(self, **row):
                return 42
            def step(self, action): ...
        class BadFinal:
            def reset(self, **row):
                return "add"
            def step(self, action):
                return "copy", 1.0, True
            def get_reward(self):
                return "great"
        class NoReward:
            def reset(self, **row):
                return "add"
            def step(self, action):
                return "copy", None, True
            def close(self):
                raise OSError("already gone")
        """)
    for name, reason in (("BadInit", "BadInit() raised RuntimeError: no sandbox"),
                         ("BadReset", "reset: reset returned int 42 as the observation")):
        ep = load_environment(EnvConfig(path=path, name=name), tok).episode({"prompt": "x"})
        assert run(ep.start()) == [] and ep.failed.startswith(reason)
    ep, _ = run(play(load_environment(EnvConfig(path=path, name="BadFinal"), tok), {"prompt": "x"}, ["1"], tok))
    assert ep.result().failed == "get_reward: get_reward returned the reward 'great'; return a finite number or None"
    ep, _ = run(play(load_environment(EnvConfig(path=path, name="NoReward"), tok), {"prompt": "x"}, ["1"], tok))
    assert ep.result().failed.startswith("env.reward=env, but the environment gave no reward")
    assert ep.result().counters["close_errors"] == 1
    ep, _ = run(play(load_environment(EnvConfig(path=path, name="NoReward", reward="function"), tok),
                     {"prompt": "x"}, ["1"], tok))
    assert ep.result().failed is None and ep.result().reward is None and ep.result().final_text == "1"


def test_close_runs_once_when_the_episode_ends(tmp_path):
    tok = chat_tokenizer()
    factory = load_environment(EnvConfig(path=write(tmp_path, GUESS_ENV)), tok)
    ep, _ = run(play(factory, {"prompt": "x"}, ["7"], tok))
    assert ep.session.env.closed and ep.result().ended_by == "done"

    async def abandon():                  # the generator shutting down closes live episodes
        ep = factory.episode({"prompt": "x"})
        await ep.start()
        await ep.close()
        await ep.close()
        return ep
    ep = run(abandon())
    assert ep.session.env.closed and ep.result().ended_by == "running" and ep.result().counters["close_errors"] == 0


@pytest.mark.parametrize("source, settings, message", [
    (None, {}, "env.py: environment file does not exist"),
    ("class E:\n    def reset(self:\n", {}, "env.py:2: syntax error"),
    ("import nope_not_a_module\n", {}, "env.py:1: importing it raised ModuleNotFoundError"),
    ("def f(): pass\n", {}, "env.py: no environment class (reset(**row) and step(action), or reset and tool methods) "
                            "and no env.tools; it defines classes none"),
    (GUESS_ENV, {"name": "Nope"}, "env.py: no class named 'Nope' (env.name); it defines classes ['Guess']"),
    (GUESS_ENV + GUESS_ENV.replace("Guess", "Other"), {}, "env.py: several classes have reset and step: Guess, Other; "
                                                          "choose one with env.name=Guess"),
    ("class E:\n    def reset(self, **row): ...\n    def step(self): ...\n", {},
     "env.py: E.step(self) cannot be called as step(self, action)"),
    ("class E:\n    def reset(self, a, /): ...\n    def step(self, action): ...\n", {},
     "env.py: E.reset(self, a, /) cannot be called as reset(self, **row)"),
    ("def calc(x):\n    \"Id.\"\n", {"tools": ["calc"], "reward": "function"},
     "env.py: tool calc: Argument x is missing a type hint in function calc"),
    ("def calc(x: int) -> int:\n    return x\n", {"tools": ["calc"], "reward": "function"},
     "env.py: tool calc: Cannot generate JSON schema for calc because it has no docstring"),
    ("def calc(x: int) -> int:\n    '''Id.\n\n    Args:\n        x: a number\n    '''\n",
     {"tools": ["calc", "sqrt"], "reward": "function"},
     "env.py: no function named 'sqrt' (env.tools); it defines ['calc']"),
    ("def calc(x: int) -> int:\n    '''Id.\n\n    Args:\n        x: a number\n    '''\n", {"tools": ["calc"]},
     "env.py: env.reward=env, but tool functions give no reward; set env.reward=function"),
])
def test_bad_env_files_are_refused_at_load_in_one_line(tmp_path, source, settings, message):
    path = str(tmp_path / "env.py") if source is None else write(tmp_path, source)
    with pytest.raises(EnvLoadError) as e:
        load_environment(EnvConfig(path=path, **settings), chat_tokenizer())
    assert message in str(e.value) and "\n" not in str(e.value) and str(tmp_path) in str(e.value)


def test_no_path_is_single_turn_and_settings_are_checked():
    from dataflow.checks import problems
    assert load_environment(EnvConfig(), chat_tokenizer()) is None
    with pytest.raises(EnvLoadError, match="env.path is empty"):
        load_environment(EnvConfig(tools=["calc"]), chat_tokenizer())
    bad = problems(EnvConfig(max_turns=0, step_timeout_s=0.0, path="/no/such/env.py"))
    assert any(line.startswith("max_turns=0") for line in bad) and any("step_timeout_s" in line for line in bad)
    assert any("/no/such/env.py does not exist" in line for line in bad)


def test_template_without_chat_template_is_refused(tmp_path):
    with pytest.raises(EnvLoadError, match="the tokenizer has no chat template"):
        load_environment(EnvConfig(path=write(tmp_path, GUESS_ENV)), chat_tokenizer(chat_template=False))


def test_a_template_that_raises_on_a_message_fails_the_episode(tmp_path):
    """Gemma-style templates raise on a role they do not know; an observation in that role fails
    the episode with the template's message."""
    tok = chat_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                         "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
                         "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = write(tmp_path, GUESS_ENV.replace("return (self.feedback,", "return ({'role': 'system', 'content': 'add'},"))
    ep, turns = run(play(load_environment(EnvConfig(path=path), tok), {"prompt": "add"}, ["1"], tok))
    assert ep.failed == "rendering the observation: TemplateError: roles must be user or assistant"
    tok.chat_template = "{{ raise_exception('no chats here') }}"
    with pytest.raises(EnvLoadError, match="env.py: the chat template cannot render a user/assistant chat: "
                                           "TemplateError: no chats here"):
        load_environment(EnvConfig(path=write(tmp_path, GUESS_ENV)), tok)


def test_threads_setting_runs_episodes_concurrently(tmp_path):
    """Eight episodes whose steps all wait for each other finish only if they run at once."""
    tok = chat_tokenizer()
    path = write(tmp_path, """
        import threading
        BARRIER = threading.Barrier(8, timeout=10)
        class Meet:
            def reset(self, **row):
                return "add"
            def step(self, action):
                BARRIER.wait()
                return "copy", 1.0, True
        """)
    factory = load_environment(EnvConfig(path=path, threads=8), tok)

    async def main():
        return await asyncio.gather(*(play(factory, {"prompt": "x"}, ["1"], tok) for _ in range(8)))
    results = run(main())
    assert all(ep.result().reward == 1.0 for ep, _ in results)


def test_the_files_in_docs_agents_md_load_and_run(tmp_path):
    """docs/agents.md's three example files, as printed there."""
    import re
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    files = {name: block for block in re.findall(r"```python\n(.*?)```", doc, re.S)
             for name in [re.match(r"# (\w+\.py)", block).group(1)]}
    assert sorted(files) == ["calc_tools.py", "counter_env.py", "guess_env.py"]
    tok = bpe_tokenizer()
    guess = load_environment(EnvConfig(path=write(tmp_path, files["guess_env.py"], "guess_env.py")), tok)
    ep, turns = run(play(guess, {"prompt": "Play.", "secret": "42"}, ["50", "I guess 42"], tok, end_token="<|im_end|>"))
    assert ep.messages[2]["content"] == "Lower." and ep.result().reward == 1.0
    calc = load_environment(EnvConfig(path=write(tmp_path, files["calc_tools.py"], "calc_tools.py"),
                                      tools=["multiply", "add"], reward="function"), tok)
    assert calc.form == "tools" and len(calc.tool_schemas) == 2
    counter = load_environment(EnvConfig(path=write(tmp_path, files["counter_env.py"], "counter_env.py")), tok)
    ep, _ = run(play(counter, {"prompt": "Count to 3."},
                     ['<tool_call>{"name": "increment", "arguments": {"step": 3}}</tool_call>', "Done."], tok))
    assert counter.form == "trl" and ep.result().reward == 1.0


def test_a_shown_rollout_of_an_episode_is_its_chat_turn_by_turn():
    """rl/agent/episode.rollout_fields: a single-turn sample shows its prompt text and response;
    an episode shows its first messages as the prompt and the rest as the response, one
    `[role] content` line each, with its turns and how it ended."""
    from rl.agent.episode import rollout_fields

    assert rollout_fields({"text": "42"}, "What is 6 * 7?") == {"prompt": "What is 6 * 7?", "response": "42"}
    messages = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "6 * 7?"},
                {"role": "assistant", "content": "<tool_call>...</tool_call>"},
                {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}]
    episode = {"text": "42", "turns": 2, "env": {"messages": messages, "first_messages": 2, "ended_by": "no_tool_call"}}
    assert rollout_fields(episode, "<|im_start|>system...") == {
        "prompt": "[system] Use the tool.\n[user] 6 * 7?",
        "response": "[assistant] <tool_call>...</tool_call>\n[tool] 42\n[assistant] 42",
        "turns": 2, "ended_by": "no_tool_call"}
