"""Rewards: loading a user's reward file, running its calls (bounded, timed out), the answer checkers
(math_reward, gsm8k_reward) and the killable worker processes they run in."""
