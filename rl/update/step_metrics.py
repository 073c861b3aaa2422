"""What a learner step (nodes/learner.py) checks and reports around its update: the step's samples,
tagged with the version each was generated under and checked against the staleness bound the
prompt source enforces, and the step's metrics record (rewards, KL, staleness, lengths, timings,
the update's own stats, the episodes' metrics).
"""

from __future__ import annotations

import math

from rl.generation.episodes import episode_metrics


def step_samples(items: list[dict], version: int, max_staleness: int) -> tuple[list[dict], list[int], list[int]]:
    """The samples of a step's items, each tagged with its item's version, and their staleness at
    learner version `version`, per sample and per token. Raises when one breaks max_staleness."""
    samples = [s for item in items for s in item["samples"]]
    for item in items:
        for s in item["samples"]:
            # The item's version is its oldest token's (a partial rollout's tokens may be
            # newer: "token_versions", nodes/generator.py), so the bound below holds per token.
            s["version"] = item["version"]
            s.setdefault("token_versions", [item["version"]] * len(s["response_ids"]))
    staleness = [version - s["version"] for s in samples]
    token_staleness = [version - v for s in samples for v in s["token_versions"]]
    if max(staleness) > max_staleness:
        raise RuntimeError(f"sample of version {min(s['version'] for s in samples)} reached learner "
                           f"version {version}: staleness {max(staleness)} > max_staleness {max_staleness}")
    return samples, staleness, token_staleness


def step_metrics(items: list[dict], samples: list[dict], staleness: list[int], token_staleness: list[int],
                 stats: dict, *, kl: float | None, kl_coef: float, lr: float, version: int, wait_s: float,
                 step_s: float, duplicates: int, record_prompt_ids: bool) -> dict:
    """The step's record for metrics.jsonl: `stats` is the update's (rl/update/ppo_update.py),
    `version` the one this step made, `kl` the KL the controller saw (None without a reference)."""
    ok = [s["score"] for s in samples if not s["failed"]]
    mean = sum(ok) / max(len(ok), 1)
    std = math.sqrt(sum((x - mean) ** 2 for x in ok) / max(len(ok), 1))
    metrics = {
        "reward/mean": mean, "reward/std": std, **({"kl": kl} if kl is not None else {}),
        "entropy": stats["entropy"], "lr": lr,
        "staleness/mean": sum(staleness) / len(staleness), "staleness/max": max(staleness),
        "staleness/token_mean": sum(token_staleness) / max(len(token_staleness), 1),
        "samples/mixed_versions": sum(len(set(s["token_versions"])) > 1 for s in samples),
        "perf/samples_per_s": len(samples) / step_s, "kl_coef": kl_coef,
        "samples/failed": len(samples) - len(ok), "response_length/mean":
            sum(len(s["response_ids"]) for s in samples) / len(samples),
        "timing/wait_batch_s": wait_s, "timing/step_s": step_s, "version": version,
        "prompts/duplicates_dropped": duplicates,
        **{k: v for k, v in stats.items() if k not in ("losses/kl", "entropy")},
    }
    if record_prompt_ids:
        metrics["prompt_ids"] = [item["id"] for item in items]
    metrics.update(episode_metrics(samples))    # multi-turn (rl/generation/episodes.py)
    return metrics
