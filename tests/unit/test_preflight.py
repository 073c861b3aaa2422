"""Inputs checked before Ray starts (dataflow/driver/preflight.py, rl/preflight.py): model directories,
datasets, prompt lengths against the model's positions, reward files against the data. No Ray:
the checks run in the driver, and the CLI exits 2 before it would start Ray."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from dataflow.driver.loading import load_graph
from dataflow.driver.preflight import input_problems
from rl.data.policy import model_dir_problems, safetensors_problem


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The built-in tiny policy (64 positions) saved as a normal HF model directory."""
    from rl.data import tasks
    from rl.model.causal_lm import ModelConfig, build_policy, save_policy

    path = tmp_path_factory.mktemp("model") / "policy"
    tokenizer = tasks.build_tokenizer()
    save_policy(build_policy(ModelConfig(), tokenizer), tokenizer, str(path))
    return path


def copy_of(model_dir, tmp_path, name="copy"):
    return shutil.copytree(model_dir, tmp_path / name)


def check(graph: str, *overrides: str) -> list[str]:
    return input_problems(*load_graph(graph, list(overrides)))


def jsonl(path, *rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_a_good_model_dir_and_the_graphs_defaults_pass(model_dir, tmp_path):
    assert model_dir_problems(str(model_dir)) == []
    for graph in ("graphs/ppo.py", "graphs/grpo.py", "graphs/dapo.py"):
        assert check(graph) == []
    data = jsonl(tmp_path / "d.jsonl", {"prompt": "copy 1 2 :", "answer": "1 2"})
    assert check("graphs/grpo.py", f"policy.path={model_dir}", f"prompts.path={data}", "max_new_tokens=4") == []


def test_a_truncated_safetensors_file_is_named_as_such(model_dir, tmp_path):
    broken = copy_of(model_dir, tmp_path)
    weights = broken / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 100)
    assert safetensors_problem(str(weights)) == (
        f"model.safetensors is truncated: {size - 100} bytes, its header describes {size} "
        "(an interrupted download or save: copy or save it again)")
    # every node loads the policy: one line, under the setting a user sets
    assert check("graphs/ppo.py", f"policy.path={broken}") == [
        f"policy.path={broken}: model.safetensors is truncated: {size - 100} bytes, its header describes {size} "
        "(an interrupted download or save: copy or save it again)"]
    with open(weights, "r+b") as f:
        f.truncate(5)
    assert "truncated (5 bytes, not even a header)" in safetensors_problem(str(weights))


def test_incomplete_model_dirs(model_dir, tmp_path):
    no_config = copy_of(model_dir, tmp_path, "a")
    os.remove(no_config / "config.json")
    assert model_dir_problems(str(no_config)) == [
        "no config.json there: not a saved HF model directory (save it with save_pretrained)"]
    bad_config = copy_of(model_dir, tmp_path, "b")
    (bad_config / "config.json").write_text("{not json")
    assert model_dir_problems(str(bad_config))[0].startswith("config.json cannot be read")
    unknown = copy_of(model_dir, tmp_path, "u")   # checked against transformers' table, not by building it
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "llama9"}))
    assert model_dir_problems(str(unknown)) == [
        "config.json cannot be read: its model_type 'llama9' is not one this transformers knows "
        "(a newer model family: upgrade transformers)"]
    no_weights = copy_of(model_dir, tmp_path, "c")
    os.remove(no_weights / "model.safetensors")
    assert model_dir_problems(str(no_weights))[0].startswith("missing weights")
    sharded = copy_of(model_dir, tmp_path, "d")
    os.rename(sharded / "model.safetensors", sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert model_dir_problems(str(sharded)) == [
        "model-00002-of-00002.safetensors (listed in model.safetensors.index.json) is missing"]
    no_tokenizer = copy_of(model_dir, tmp_path, "e")
    os.remove(no_tokenizer / "tokenizer.json")
    assert model_dir_problems(str(no_tokenizer)) == [
        "no tokenizer.json; save one with tokenizer.save_pretrained(path)"]


def test_each_check_is_timed_by_the_setting_it_checks(model_dir, tmp_path):
    """What `dataflow.run` prints when the checks are slow: seconds per checked setting (the graph
    config's own check under its class name), none missing, adding up to about the whole."""
    import time

    data = jsonl(tmp_path / "d.jsonl", *({"prompt": f"copy {i} 2 :", "answer": f"{i} 2"} for i in range(50)))
    graph, config = load_graph("graphs/grpo.py", [f"policy.path={model_dir}", f"prompts.path={data}", "max_new_tokens=4"])
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    assert input_problems(graph, config, seconds=seconds) == []
    whole = time.perf_counter() - t0
    assert {"policy", "GRPOGraphConfig.preflight"} <= seconds.keys(), seconds
    assert all(s >= 0 for s in seconds.values()) and sum(seconds.values()) <= whole, (seconds, whole)


def test_cli_gives_one_line_and_exit_2_without_starting_ray(model_dir, tmp_path, capsys):
    """A missing or broken policy dir: the same one line every time, whichever node would have
    loaded it first (before: a traceback from some node, exit 1, after Ray's start-up)."""
    import ray

    from dataflow.run import main

    broken = copy_of(model_dir, tmp_path)
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    outputs = []
    for _ in range(2):
        assert main(["graphs/ppo.py", "--max-steps", "1", "--set", f"policy.path={broken}"]) == 2
        outputs.append(capsys.readouterr().err)
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 1
    assert outputs[0].startswith(f"error: policy.path={broken}: model.safetensors is truncated (1000 bytes; its header alone is")
    assert main(["graphs/ppo.py", "--set", "max_new_tokens=100000"]) == 2
    assert capsys.readouterr().err == (
        "error: max_new_tokens=100000: the model has 64 positions (policy.model.max_position_embeddings) for "
        "prompt and response together; set it below 64\n")
    assert not ray.is_initialized()


def test_datasets_that_give_no_usable_row(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert check("graphs/ppo.py", f"prompts.path={empty}", "max_new_tokens=4") == [
        f"prompts.path={empty}: no rows at all (an empty file?); give a dataset with prompts"]
    bad = tmp_path / "bad.jsonl"   # malformed JSON, a non-UTF-8 byte, no "prompt" field
    bad.write_bytes(b'{"prompt": "copy 1 :"\n{"prompt": "copy \xff :"}\n{"text": "copy 1 :"}\n')
    found = check("graphs/ppo.py", f"prompts.path={bad}", "max_new_tokens=4", "prompts.skip_bad_lines=true")
    assert len(found) == 1 and found[0].startswith(
        f"prompts.path={bad}: no usable rows: all 3 were skipped (prompts.skip_bad_lines=true); the first: {bad}:1:")
    assert found[0].endswith("invalid JSON (Expecting ',' delimiter); write one JSON object per line")
    # without skipping: the loader's own message for the first bad row (what the prompt source says)
    found = check("graphs/ppo.py", f"prompts.path={bad}", "max_new_tokens=4")
    assert len(found) == 1 and found[0].startswith(f"{bad}:1:") and "prompts.skip_bad_lines=true" in found[0]


def test_prompt_lengths_against_the_models_positions(model_dir, tmp_path):
    """Before: the message advised raising generator.max_prompt_tokens (already 4x the context), and
    raised further the run trained on 5,004-token sequences with the 64-position model."""
    long = jsonl(tmp_path / "long.jsonl", {"prompt": "copy 1 :", "answer": "1"},
                 {"prompt": "copy " + "1 " * 100 + ":", "answer": "1"})
    assert check("graphs/ppo.py", f"policy.path={model_dir}", f"prompts.path={long}", "max_new_tokens=4") == [
        f"prompts up to 103 tokens (the longest: {long}:2) + max_new_tokens 4 > the model's 64 positions "
        f"({model_dir}/config.json max_position_embeddings); cut the prompts with prompts.max_prompt_tokens=60 and "
        "prompts.truncation=left, or lower max_new_tokens"]
    # cut as advised, it fits
    assert check("graphs/ppo.py", f"policy.path={model_dir}", f"prompts.path={long}", "max_new_tokens=4",
                 "prompts.max_prompt_tokens=60", "prompts.truncation=left") == []
    # the built-in task's prompts too (no data file): num_digits=70 makes 73-token prompts
    assert check("graphs/grpo.py", "prompts.num_digits=70", "max_new_tokens=4") == [
        "prompts up to 73 tokens (the longest: prompts.task=copy with prompts.num_digits=70) + max_new_tokens 4 > "
        "the model's 64 positions (policy.model.max_position_embeddings); lower max_new_tokens"]


def test_the_reward_against_the_rows_fields(tmp_path):
    no_answer = jsonl(tmp_path / "q.jsonl", {"prompt": "copy 1 :"}, {"prompt": "copy 2 :", "answer": "2"})
    assert check("graphs/ppo.py", f"prompts.path={no_answer}", "max_new_tokens=4") == [
        f"prompts.path={no_answer}: 1 of 2 rows have no `answer` field (a string; the first: {no_answer}:1); the "
        "built-in scorer (reward.path empty) needs one: set reward.path to your reward file, or prompts.answer_key "
        "to the field that holds the answer"]
    verl = tmp_path / "verl.py"
    verl.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    assert check("graphs/ppo.py", f"prompts.path={no_answer}", "max_new_tokens=4", f"reward.path={verl}",
                 "reward.function=compute_score") == [
        f"prompts.path={no_answer}: 1 of 2 rows have neither reward_model.ground_truth nor an `answer` field (the "
        f"first: {no_answer}:1), which compute_score ({verl}), verl's compute_score, needs as its ground_truth; set "
        "prompts.answer_key to the field that holds it"]
    needs = tmp_path / "needs.py"
    needs.write_text("def reward(prompt, response, answer, difficulty, bonus=0.0):\n    return 0.0\n")
    ok = jsonl(tmp_path / "ok.jsonl", {"prompt": "copy 1 :", "answer": "1"})
    assert check("graphs/ppo.py", f"prompts.path={ok}", "max_new_tokens=4", f"reward.path={needs}") == [
        f"reward.path={needs}: reward ({needs}) takes `difficulty`, which the one row of prompts.path={ok} lack "
        f"(the first: {ok}:1); give the parameter a default or add the field to the data"]
    broken = tmp_path / "broken.py"
    broken.write_text("def reward(prompt, response:\n")
    assert check("graphs/ppo.py", f"reward.path={broken}") == [
        f"reward.path: {broken}:1: syntax error: '(' was never closed"]
    batched = tmp_path / "trl.py"
    batched.write_text("def reward(prompts, completions, answer, **kwargs):\n    return [0.0] * len(completions)\n")
    assert check("graphs/ppo.py", f"prompts.path={ok}", "max_new_tokens=4", f"reward.path={batched}") == []


def test_a_reward_model_dir_must_be_a_one_label_classifier(model_dir, tmp_path):
    assert check("graphs/ppo.py", "reward_kind=model") == [
        "reward_model.path is empty: set --set reward_model.path=/dir/of/a/sequence/classifier"]
    assert check("graphs/ppo.py", "reward_kind=model", f"reward_model.path={model_dir}") == [
        f"reward_model.path={model_dir}: num_labels=2, a reward model has 1 (a sequence classifier with one output)"]


def test_a_user_node_kind_brings_its_own_preflight(tmp_path):
    graph_file = tmp_path / "own.py"
    graph_file.write_text(
        "from dataclasses import dataclass, field\n"
        "from dataflow import Graph\nfrom tests.graphs.toy import Collect, Counter\n"
        "@dataclass\nclass Source:\n    path: str = ''\n"
        "    def preflight(self):\n        return [] if self.path.endswith('.txt') else [f'path={self.path}: not a .txt']\n"
        "@dataclass\nclass Cfg:\n    source: Source = field(default_factory=Source)\n"
        "config = Cfg()\n"
        "class Reading(Counter):\n    Config = Source\n"
        "def build(cfg):\n    g = Graph('own')\n    g.node('read', Reading, cfg.source)\n"
        "    g.node('sink', Collect, Collect.Config(), ends_run=True)\n    g.channel('read.numbers', 'sink.squares', capacity=4)\n    return g\n")
    assert check(str(graph_file), "source.path=a.csv") == ["source.path=a.csv: not a .txt"]
    assert check(str(graph_file), "source.path=a.txt") == []


@pytest.mark.parametrize("source, settings, message", [
    (None, [], "env.path='{path}': {path} does not exist"),
    ("class E:\n    def reset(self:\n", [], "{path}:2: syntax error"),
    ("def f(): pass\n", [], "{path}: no environment class"),
    ("class E:\n    def reset(self, **row): ...\n    def step(self): ...\n", [],
     "{path}: E.step(self) cannot be called as step(self, action)"),
    ("def calc(x):\n    'Id.'\n    return x\n", ["env.tools=[calc]", "env.reward=function"],
     "{path}: tool calc: Argument x is missing a type hint"),
    ("class E:\n    def reset(self, **row): ...\n    def step(self, action): ...\n", ["prompts.apply_chat_template=true"],
     "prompts.apply_chat_template=true renders string prompts before the environment renders them again"),
])
def test_a_bad_environment_file_is_one_line_and_exit_2_before_ray(tmp_path, capsys, monkeypatch, source, settings,
                                                                  message):
    """graphs/agent.py: an env file that is missing, does not parse, has no environment class, a step
    that cannot be called, a tool without type hints, or prompts rendered before the environment renders
    them: one line naming the file or setting, exit 2, before
    Ray starts (before: a node's failed set-up after start-up; a missing file twice, once per copy
    of the shared env setting). Starting Ray is booby-trapped here."""
    import ray

    from dataflow.run import main

    def trap(*a, **k):
        raise AssertionError("a bad env file must be refused before Ray starts")

    monkeypatch.setattr(ray, "init", trap)
    monkeypatch.setattr("dataflow.driver.runtime.start_ray", trap)

    path = tmp_path / "env.py"
    if source is not None:
        path.write_text(source)
    sets = [x for s in [f"env.path={path}", *settings] for x in ("--set", s)]
    assert main(["graphs/agent.py", "--max-steps", "1", *sets]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message.format(path=path) in err, err
    assert not ray.is_initialized()


def test_mistakes_once_found_late_are_one_line_before_ray(tmp_path, capsys, monkeypatch):
    """Mistakes that used to get past the checks: --out naming a file (a traceback, exit 1, at the
    first metrics write; an earlier run's directory: its metrics truncated, its checkpoints mixed in; --trace's directory at the run's end; --compile-cache in a node's set-up), reward.function / reward.kwargs without reward.path (silently ignored: the
    built-in scorer ran), a missing val.path and LoRA with several learner ranks (a node's failed
    set-up after start-up), a graph's single problem (two lines). Each is one line, exit 2, before
    Ray starts (booby-trapped here)."""
    import ray

    from dataflow.run import main

    def trap(*a, **k):
        raise AssertionError("refused before Ray starts")

    monkeypatch.setattr(ray, "init", trap)
    monkeypatch.setattr("dataflow.driver.runtime.start_ray", trap)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    earlier, resumable = tmp_path / "earlier", tmp_path / "resumable"   # an earlier run's directory
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text('{"step": 1}\n')
    (resumable / "checkpoints" / "step_3").mkdir(parents=True)
    (resumable / "checkpoints" / "step_3" / "manifest.json").write_text("{}")
    cases = [
        (["--out", str(earlier)], f"error: --out {earlier} holds an earlier run (metrics.jsonl): give a new --out, "
                                  f"or delete {earlier} first"),
        (["--out", str(resumable)], f"error: --out {resumable} holds an earlier run (checkpoints up to step_3): "
                                    f"continue it with --resume {resumable}, or give a new --out"),
        (["--out", str(a_file)], f"error: --out {a_file}: a file is there; give a directory (it is made if missing)"),
        (["--out", str(a_file / "run")], f"error: --out {a_file / 'run'}: {a_file} is a file, not a directory"),
        (["--compile-cache", str(a_file)], f"error: --compile-cache {a_file}: a file is there"),
        (["--trace", str(a_file / "t.json")], f"error: --trace {a_file / 't.json'}: its directory {a_file}: a file"),
        (["--set", "reward.function=accuracy"], "error: reward.function=[accuracy]: is for the functions of "
                                                "reward.path, which is empty"),
        (["--set", 'reward.kwargs={"k": 1}'], "error: reward.kwargs={'k': 1}: is for the functions of reward.path"),
        (["--set", f"val.path={tmp_path / 'val.jsonl'}"], f"error: val.path='{tmp_path / 'val.jsonl'}': "
                                                          f"{tmp_path / 'val.jsonl'} does not exist"),
        # the learner's own checks, once found only in its set-up after start-up
        (["--set", "learner.lora.rank=8", "--set", "learner.dp=2"], "error: learner.lora.rank > 0 with "
                                                                    "learner.dp x learner.tp > 1 is not supported"),
        (["--set", "learner.own_reference=true"], "error: learner.own_reference needs learner.lora.rank > 0"),
        # a graph's one problem is one line too (several are listed under a header)
        (["--set", "loggers=nope"], "error: graphs/grpo.py: loggers: unknown 'nope'; choose from"),
    ]
    for argv, start in cases:
        assert main(["graphs/grpo.py", "--max-steps", "1", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith(start), (argv, err)


def test_the_checks_take_the_rows_the_memory_plan_read_and_do_not_hold_them(tmp_path, monkeypatch):
    # On a GPU placement the plan reads the prompts for their longest (rl/preflight.longest_prompt);
    # the checks then use that read instead of reading the file again, and the rows are not kept.
    import rl.preflight as preflight

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": "1+2" * (i % 5 + 1) + "=", "answer": "3"}) + "\n" for i in range(50)))
    reads = []
    read = preflight._read_rows
    monkeypatch.setattr(preflight, "_read_rows", lambda *a: reads.append(1) or read(*a))
    graph, config = load_graph("graphs/grpo.py", ["placement=colocated", "gpu_memory_gib=80", f"prompts.path={data}", "max_new_tokens=8"])
    assert config.generator.max_prompt_tokens == 64 and len(reads) == 1 and preflight._ROWS
    assert input_problems(graph, config) == []
    assert len(reads) == 1 and not preflight._ROWS
    data.write_text(data.read_text() + json.dumps({"prompt": "9=", "answer": "9"}) + "\n")   # a changed file is read again
    preflight.longest_prompt(config.prompts)
    assert len(reads) == 2
    preflight._ROWS.clear()


def test_model_types_are_read_from_transformers_source_as_its_table_holds_them():
    """rl/data/policy.known_model_type reads transformers' CONFIG_MAPPING_NAMES from its source, so
    that the driver's policy check imports no transformers: the same set as the imported table
    (a new layout of that source makes this fail: the check still answers right, by importing)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from rl.data import policy

    assert policy._model_types_in_source() == frozenset(CONFIG_MAPPING_NAMES)
    assert policy.known_model_type("qwen2") and not policy.known_model_type("no_such_model_type")
