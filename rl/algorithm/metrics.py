"""Validation metrics: mean@1 (greedy), mean@n, pass@k, per data source. Pure functions, no Ray.

A validation prompt is answered once greedily (temperature 0) and n times at the training
temperature; every response is scored by the training's reward function.
  mean@1  the mean score of the greedy responses (verl's `mean@1`; for a 0/1 reward, greedy accuracy)
  mean@n  the mean score of the n sampled responses (verl's `mean@N`)
  pass@k  the chance that at least one of k responses drawn without replacement from the n
          sampled ones is correct (score > `correct_above`), estimated without bias from the
          c correct of n (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", §2.1)
Scores are means of the reward as it is (a partial-credit reward gives a partial mean); only
pass@k needs a yes/no per response, hence the threshold. A response whose reward failed scores 0.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as Chen et al.'s numerically stable product 1 - prod_{i=n-c+1}^{n} (1 - k / i)
    (no huge binomials). Needs 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:   # every k-subset holds a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


@dataclass
class PromptResult:
    """One validation prompt's scores: the greedy response's and the n sampled ones'."""
    greedy: float
    samples: list[float] = field(default_factory=list)
    data_source: str | None = None


def validation_metrics(results: list[PromptResult], ks: list[int], correct_above: float = 0.5,
                       prefix: str = "val") -> dict[str, float]:
    """{"val/mean@1", "val/mean@<n>", "val/pass@<k>" for k in ks} over all prompts, and the same
    under "val/<data_source>/" for each data source present. Every prompt has the same n (0: only
    mean@1). pass@k is the mean of each prompt's pass_at_k(n, c, k)."""
    if not results:
        return {}
    n = len(results[0].samples)
    if any(len(r.samples) != n for r in results):
        raise ValueError("validation_metrics: every prompt needs the same number of samples")
    groups: dict[str, list[PromptResult]] = defaultdict(list)
    for r in results:
        groups[prefix].append(r)
        if r.data_source is not None:
            groups[f"{prefix}/{r.data_source}"].append(r)
    out: dict[str, float] = {}
    for name, rows in groups.items():
        out[f"{name}/mean@1"] = sum(r.greedy for r in rows) / len(rows)
        if n:
            out[f"{name}/mean@{n}"] = sum(sum(r.samples) for r in rows) / (n * len(rows))
            for k in ks:
                out[f"{name}/pass@{k}"] = sum(pass_at_k(n, sum(s > correct_above for s in r.samples), k)
                                              for r in rows) / len(rows)
    return out
