"""Observation tokens from the chat template: the first prompt, and each turn's delta.

The trajectory is one token sequence: prompt ids, then sampled ids and environment ids in turns.
Sampled ids are never decoded and re-encoded (BPE is not a bijection: TRL#5224). The environment's
ids of a turn are what the chat template writes between the model's text and the next generation:

    render(history + [assistant] + new, add_generation_prompt=True)
        minus render(history + [assistant])                 -> the new messages + generation prompt
    plus the template's end-of-turn text after the assistant's content (`tail`, e.g. "<|im_end|>\\n")
        minus the end-of-turn token when the model sampled it (it stopped on it): else the tokens
        would repeat it, or, when a turn is cut by the token limit, lose it. Dropping the rest
        ("\\n") is the separator lost at every turn boundary in verl PR #6921; TRL keeps it the
        same way (trl/trainer/grpo_trainer.py `_get_tool_suffix_ids`, v1.16: the prefix render is
        cut after its last eos).

Each delta is checked: the shorter render must be a prefix of the longer (append-only). A template
that re-renders earlier turns differently (Qwen3-style templates drop earlier <think> blocks,
verl#6854) fails the check; then, with non_append_template=keep, the history stays as sampled and
the new messages are rendered alone, after a stand-in user/assistant pair (TRL's method), and the
turn is counted; with non_append_template=error the episode fails with the reason.

Renders are text (tokenize=False) and only the delta's text is encoded; its boundaries are special
tokens (`<|im_start|>`), so the ids equal the full render's ids there (tests/unit/test_agent_env.py).
"""

from __future__ import annotations

from typing import Any

SENTINEL = "\x00sampled\x00"
"""Stand-in content of an assistant message, to find the template's text around it."""


class TemplateMismatch(ValueError):
    """The chat template is not append-only at this turn (the message says where)."""


class Renderer:
    """Renders chats with one tokenizer's template, for one environment's tool schemas.

    `tools`: OpenAI function schemas passed as `tools=` to every render; empty when the template
    has no tools section (the tools are then in a system message: rl/agent/tools.py).
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, keep_on_mismatch: bool = True):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; multi-turn episodes render every "
                             "turn with it (use an instruct model's directory)")
        self.tokenizer = tokenizer
        self.tools = list(tools or [])
        self.keep_on_mismatch = keep_on_mismatch
        self.tail = self._around_sentinel([{"role": "user", "content": "x"}])[1]
        """The template's text after an assistant message's content ("<|im_end|>\\n" in ChatML)."""
        tail_ids = self.encode(self.tail)
        first = self.tokenizer.convert_ids_to_tokens(tail_ids[0]) if tail_ids else ""
        special = bool(tail_ids) and tail_ids[0] in set(self.tokenizer.all_special_ids) | set(
            getattr(self.tokenizer, "added_tokens_decoder", {}))
        self.end_of_turn_id: int | None = tail_ids[0] if special and self.tail.startswith(first) else None
        """The first token of `tail` when it is a special token: the model stops on it."""
        self._tail_rest = self.tail[len(first):] if self.end_of_turn_id is not None else self.tail

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        kwargs = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt, **kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _around_sentinel(self, history: list[dict]) -> tuple[str, str]:
        text = self.render(history + [{"role": "assistant", "content": SENTINEL}], generation_prompt=False)
        if text.count(SENTINEL) != 1:
            raise ValueError("the chat template does not write an assistant message's content as given; "
                             "multi-turn episodes need one that does")
        before, after = text.split(SENTINEL)
        return before, after

    def first(self, messages: list[dict]) -> list[int]:
        """The prompt: the first messages and the generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def turn_end(self, sampled_ids: list[int]) -> str:
        """The template's end-of-turn text still owed after the sampled ids: the tail, less its
        end-of-turn token when the model sampled it last."""
        if self.end_of_turn_id is not None and sampled_ids and sampled_ids[-1] == self.end_of_turn_id:
            return self._tail_rest
        return self.tail

    def delta(self, history: list[dict], new: list[dict]) -> tuple[str, bool]:
        """(text of `new` and the next generation prompt, as rendered after `history`, whose last
        message is the assistant's; True when the template was not append-only and `new` was
        rendered alone). TemplateMismatch when not append-only and not keeping."""
        before = self.render(history, generation_prompt=False)
        after = self.render(history + new, generation_prompt=True)
        if after.startswith(before) and before.endswith(self.tail):
            return after[len(before):], False
        where = _first_difference(before, after)
        if not self.keep_on_mismatch:
            raise TemplateMismatch(f"the chat template is not append-only: adding a {new[0]['role']} message "
                                   f"changes the earlier text at character {where} ({before[where:where + 40]!r}); "
                                   "set env.non_append_template=keep to keep the history as sampled")
        stand_in = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]
        before = self.render(stand_in, generation_prompt=False)
        after = self.render(stand_in + new, generation_prompt=True)
        if not after.startswith(before):
            raise TemplateMismatch(f"the chat template renders a {new[0]['role']} message differently "
                                   "from the conversation before it; it cannot be used for multi-turn episodes")
        return after[len(before):], True

    def observation(self, sampled_ids: list[int], history: list[dict], new: list[dict]) -> tuple[list[int], bool]:
        """Environment ids after `sampled_ids`: the rest of the assistant turn, `new`, the next
        generation prompt. Returns (ids, rendered alone)."""
        text, alone = self.delta(history, new)
        return self.encode(self.turn_end(sampled_ids) + text), alone


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
