"""The settings checks of the learner and of every node's passes, without torch: the node
declarations run them before Ray starts (their check_settings, dataflow/driver/preflight.py) and
the nodes again in setup. rl/update/ppo_update.py and microbatch.py import them from here.
"""

from __future__ import annotations

from dataflow.errors import SettingError, UserError


def check_micro_batch_settings(node: str, micro_batch_size: int, max_tokens: int) -> None:
    """A node's two ways to split its passes: rows or tokens, not both (ValueError naming them)."""
    if max_tokens < 0 or micro_batch_size < 0:
        raise SettingError(f"{node}.micro_batch_size={micro_batch_size}, {node}.max_tokens_per_micro_batch="
                         f"{max_tokens}: must be >= 0")
    if max_tokens and micro_batch_size:
        raise SettingError(f"{node}.micro_batch_size={micro_batch_size} and {node}.max_tokens_per_micro_batch="
                         f"{max_tokens} both split the passes; set one of them to 0 (tokens bound memory "
                         "whatever the lengths; rows are the older setting)")


def resolved_advantage(c) -> str:
    """learner.advantage with "auto" resolved: gae in the PPO graph (a critic), else grpo."""
    if c.advantage != "auto":
        return c.advantage
    return "gae" if c.algorithm == "ppo" else "grpo"


def resolved_loss_agg_mode(c) -> str:
    """learner.loss_agg_mode with "auto" resolved: each recipe's own (GSPO averages over
    sequences, Dr. GRPO divides by a constant), token-mean otherwise (DAPO's, and today's)."""
    if c.loss_agg_mode != "auto":
        return c.loss_agg_mode
    if c.policy_loss == "gspo":
        return "seq-mean-token-mean"
    if resolved_advantage(c) == "dr_grpo":
        return "seq-mean-token-sum-norm"
    return "token-mean"


def check_config(c, max_steps: int | None) -> None:
    """Raise UserError naming the setting when the learner's settings do not fit together."""
    advantage = resolved_advantage(c)
    try:
        check_micro_batch_settings("learner", c.micro_batch_size, c.max_tokens_per_micro_batch)
    except ValueError as e:
        raise UserError(str(e)) from None
    if advantage == "gae" and c.algorithm != "ppo":
        raise UserError("learner.advantage=gae needs the critic's values: run graphs/ppo.py, or pick grpo, "
                        "dr_grpo, rloo or reinforce_pp")
    if advantage == "gae" and (c.kl.placement == "reward" or c.overlong_buffer):
        raise UserError("learner.kl.placement=reward and learner.overlong_buffer change the rewards, but with "
                        "advantage=gae the critic has computed GAE from them before the learner sees the batch; "
                        "use them with a learner-side advantage (grpo, dr_grpo, rloo, reinforce_pp)")
    if resolved_loss_agg_mode(c) == "seq-mean-token-sum-norm" and not (c.loss_scale_factor or c.max_new_tokens) > 0:
        raise UserError("learner.loss_agg_mode=seq-mean-token-sum-norm divides by a constant: set "
                        "learner.loss_scale_factor or learner.max_new_tokens (the generators' max_new_tokens)")
    if c.overlong_buffer and not 0 < c.overlong_buffer <= c.max_new_tokens:
        raise UserError(f"learner.overlong_buffer={c.overlong_buffer} must be in (0, learner.max_new_tokens="
                        f"{c.max_new_tokens}]; set learner.max_new_tokens to the generators' max_new_tokens")
    if c.own_reference and not c.lora.rank:
        raise UserError("learner.own_reference needs learner.lora.rank > 0 (the reference is the base with the "
                        "adapter disabled); without LoRA the graph's reference node computes them")
    if c.lora.rank and c.dp * c.tp > 1:
        raise UserError("learner.lora.rank > 0 with learner.dp x learner.tp > 1 is not supported yet: "
                        "use one learner rank (dp=1, tp=1) or lora.rank=0")
    s = c.schedule
    if s.decay != "constant" and not (s.total_steps or max_steps or 0) > s.warmup_steps:
        raise UserError(f"learner.schedule.decay={s.decay} decays over the run's steps: set "
                        f"learner.schedule.total_steps (> warmup_steps={s.warmup_steps}) or --max-steps")
