"""The guessing game: a gym-style environment, one instance per episode (env.path=this file).

    python -m dataflow.run graphs/agent.py --set env.path=examples/agents/guess_env.py ...

The row holds a secret number; the model guesses, the environment answers "Higher." or "Lower."
until the guess is right or the turns run out. Success needs the feedback: one blind guess in
1..100 is right 1 time in 100, while halving the range on each answer finds any number in 7.
A guess is the first whole number in the model's message; a message without one is told so and
costs its turn. Reward: 1.0 on the turn the guess is right, and `consistent_bonus` (default 0) for
each wrong guess that the answers so far still allowed (inside the range they leave): the
episode's reward is the sum of the step rewards. Why the bonus: a 135M model wins about 1 game in
25 by guessing blindly; guessing anywhere inside the range the answers leave already wins about half
of the games (7 guesses over 1..100), so rewarding that step gives the policy a signal long before
it wins often. The held-out judge (judge.py) counts wins only.
"""

import re

_INTEGER = re.compile(r"-?\d+")


def first_integer(text: str) -> int | None:
    """The first whole number in `text`, or None: how a guess is read (the judge reads it alike)."""
    found = _INTEGER.search(text)
    return int(found.group()) if found else None


class GuessingGame:
    """reset(**row) -> the first user message; step(action) -> (observation, reward, done, info)."""

    def __init__(self, max_guesses: int = 7, consistent_bonus: float = 0.0):
        self.max_guesses = max_guesses
        self.consistent_bonus = consistent_bonus

    def reset(self, secret, low=1, high=100, **row) -> str:
        self.secret, self.low, self.high, self.guesses = int(secret), int(low), int(high), 0
        self.allowed = (self.low, self.high)    # the range the answers so far leave
        return (f"I am thinking of a whole number between {self.low} and {self.high}. Guess it. After each "
                f"guess I say whether my number is higher or lower. You have {self.max_guesses} guesses. "
                "Answer with only your guess.")

    def step(self, action: str):
        self.guesses += 1
        guess = first_integer(action)
        left = self.max_guesses - self.guesses
        if guess == self.secret:
            return "Correct!", 1.0, True, {"guesses": self.guesses, "won": True}
        low, high = self.allowed
        reward = self.consistent_bonus if guess is not None and low <= guess <= high else 0.0
        if guess is not None:
            self.allowed = (max(low, guess + 1), high) if self.secret > guess else (low, min(high, guess - 1))
        if left <= 0:
            return f"Wrong. My number was {self.secret}.", reward, True, {"guesses": self.guesses, "won": False}
        if guess is None:
            text = f"Answer with only a whole number between {self.low} and {self.high}."
        else:
            text = "Higher." if self.secret > guess else "Lower."
        return f"{text} {left} guesses left.", reward, False, {"guesses": self.guesses, "won": False}
