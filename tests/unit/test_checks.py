"""dataflow/checks.py: constraints declared beside settings, checked over a whole config tree."""

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

import pytest

from dataflow.checks import AtLeast, Each, ExistingPath, Fraction, NonNegative, OneOf, Positive, Range, problems
from dataflow.config import apply_overrides


@dataclass(kw_only=True)
class Inner:
    lr: Annotated[float, Positive] = 1e-3
    share: Annotated[float, Fraction] = 0.5
    path: Annotated[str, ExistingPath(kind="dir")] = ""
    mode: Literal["a", "b"] = "a"


@dataclass(kw_only=True)
class Outer:
    steps: Annotated[int, AtLeast(1)] = 10
    staleness: Annotated[int, NonNegative] = 1
    clip: Annotated[float, Range(0, 1, low_open=True, note="a fraction")] = 0.2
    inner: Inner = field(default_factory=Inner)


def test_defaults_pass_and_set_still_converts_through_annotated_types():
    assert problems(Outer()) == []
    cfg = apply_overrides(Outer(), ["steps=5", "inner.lr=0.5", "inner.mode=b"])
    assert (cfg.steps, cfg.inner.lr, cfg.inner.mode) == (5, 0.5, "b")


def test_every_violation_is_one_line_naming_the_dotted_setting(tmp_path):
    cfg = apply_overrides(Outer(), ["steps=0", "staleness=-1", "clip=0", "inner.lr=-2",
                                    "inner.share=1.5", f"inner.path={tmp_path / 'missing'}"])
    found = problems(cfg)
    assert found == [
        "steps=0: must be >= 1",
        "staleness=-1: must be >= 0",
        "clip=0.0: must be > 0 and <= 1 (a fraction)",
        "inner.lr=-2.0: must be > 0",
        "inner.share=1.5: must be > 0 and <= 1",
        f"inner.path='{tmp_path / 'missing'}': {tmp_path / 'missing'} does not exist",
    ]


def test_non_finite_numbers_and_wrong_kinds_of_path(tmp_path):
    (tmp_path / "f.txt").write_text("x")
    cfg = apply_overrides(Outer(), ["inner.lr=nan", f"inner.path={tmp_path / 'f.txt'}"])
    assert problems(cfg) == ["inner.lr=nan: must be a finite number > 0",
                             f"inner.path='{tmp_path / 'f.txt'}': {tmp_path / 'f.txt'} is not a directory"]


# ---- the graphs' own configs: ranges refused by load_graph, before build and before Ray ----------


@dataclass(kw_only=True)
class Lists:
    betas: Annotated[list[float], Each(Range(0, 1, high_open=True), count=2)] = field(default_factory=lambda: [0.9, 0.99])
    shares: Annotated[dict[str, float], Each(Fraction)] = field(default_factory=dict)
    task: Annotated[str, OneOf(("copy", "sort"))] = "copy"
    mode: Literal["a", "b"] | None = None


@dataclass(kw_only=True)
class Base:
    steps: Annotated[int, AtLeast(1)] = 10


@dataclass(kw_only=True)
class Child(Base):
    steps: int = 3   # a new default keeps the base's constraint
    rules: ClassVar[tuple] = ()


def test_lists_dicts_choices_and_literals_assigned_in_python():
    cfg = Lists(betas=[0.9], shares={"learner": 1.5}, task="reverse", mode="c")
    assert problems(cfg) == ["betas=[0.9]: give 2 values", "shares={'learner': 1.5}: 'learner': 1.5 must be > 0 and <= 1",
                             "task='reverse': choose one of copy, sort", "mode='c': choose one of a, b, None"]
    assert problems(Lists(betas=[0.9, 1.0])) == ["betas=[0.9, 1.0]: each value must be >= 0 and < 1 (got 1.0)"]
    assert problems(Child()) == [] and problems(Child(steps=0)) == ["steps=0: must be >= 1"]


def test_cli_refuses_bad_settings_with_one_line_each_before_anything_starts(capsys):
    """The issue's cases: before this check, max_staleness=-1 ran and waited forever, and
    prompts_per_step=-4 died 30 s in with a traceback; --describe accepted both."""
    from dataflow.run import main

    assert main(["graphs/ppo.py", "--describe", "--set", "max_staleness=-1", "--set", "prompts_per_step=-4",
                 "--set", "learner.lr=0", "--set", "generator.top_k=-1"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.splitlines() == [
        "error: generator.top_k=-1: must be >= 0", "error: learner.lr=0.0: must be > 0",
        "error: max_staleness=-1: must be >= 0", "error: prompts_per_step=-4: must be >= 1"]


def test_subclass_defaults_shared_values_and_missing_paths_are_named_by_the_setting_a_user_sets(tmp_path):
    import graphs.dapo
    import graphs.grpo
    from dataflow.driver.loading import load_graph
    from dataflow.checks import SettingProblems

    def refused(graph: str, *overrides: str) -> list[str]:
        with pytest.raises(SettingProblems) as e:
            load_graph(graph, list(overrides))
        return e.value.lines

    # GRPO redeclares prompts_per_step (default 16): RLHFConfig's constraint still holds
    assert refused("graphs/grpo.py", "prompts_per_step=0") == ["prompts_per_step=0: must be >= 1"]
    # the sampling temperature is shared into the learner and the reference, which divide by it
    assert refused("graphs/grpo.py", "generator.temperature=0") == [
        "generator.temperature=0.0: must be > 0 (the graph shares it with learner.temperature, reference.temperature)"]
    assert refused("graphs/dapo.py", "group_size=1") == ["group_size=1: must be >= 2 (a group filter compares responses)"]
    missing = tmp_path / "no_model"
    assert refused("graphs/ppo.py", f"policy.path={missing}", f"reward.path={tmp_path}") == [
        f"policy.path='{missing}': {missing} does not exist", f"reward.path='{tmp_path}': {tmp_path} is not a file"]
    for graph in ("graphs/ppo.py", "graphs/grpo.py", "graphs/dapo.py"):   # every default is allowed
        load_graph(graph, [])


def test_a_node_config_outside_the_graph_config_is_named_by_its_node(tmp_path):
    from dataflow.driver.loading import load_graph
    from dataflow.checks import SettingProblems

    graph_file = tmp_path / "own.py"
    graph_file.write_text(
        "from dataclasses import dataclass\nfrom typing import Annotated\n"
        "from dataflow import Graph\nfrom dataflow.checks import AtLeast\nfrom tests.graphs.toy import Counter\n"
        "@dataclass\nclass Cfg:\n    n: Annotated[int, AtLeast(1)] = 0\n"
        "class Checked(Counter):\n    Config = Cfg\n"
        "graph = Graph('own')\ngraph.node('count', Checked, Cfg())\n")
    with pytest.raises(SettingProblems) as e:
        load_graph(str(graph_file))
    assert e.value.lines == ["node 'count': n=0: must be >= 1"]


# ---- one setting, one place (issue 35): the algorithm a graph is wired for, cross-setting checks
# before Ray starts, rules that name real settings ----------------------------------------------

def test_setting_the_algorithm_a_graph_is_wired_for_is_a_one_line_error(capsys):
    """graphs/grpo.py's build() used to overwrite learner.algorithm, so --set learner.algorithm=ppo
    was silently ignored; now each graph's config holds its algorithm and refuses another."""
    from dataflow.run import main

    for graph, other, wired in [("grpo", "ppo", "grpo"), ("dapo", "ppo", "grpo"), ("ppo", "grpo", "ppo")]:
        assert main([f"graphs/{graph}.py", "--describe", "--set", f"learner.algorithm={other}"]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(f"error: learner.algorithm={other}: graphs/{graph}.py is wired for {wired} "), line
        assert main([f"graphs/{graph}.py", "--describe", "--set", f"learner.algorithm={wired}"]) == 0
        assert f"learner.algorithm = '{wired}'" in capsys.readouterr().out    # --describe shows what runs


def test_cross_setting_checks_run_before_ray_starts(capsys, monkeypatch):
    """The learner's check_config and the critic's micro-batch settings used to run in the nodes'
    setup, after Ray and every actor had started; now the CLI refuses them first."""
    import dataflow.driver.runtime
    from dataflow.run import main

    class RayStarted(Exception):
        pass

    async def start_ray(*args, **kwargs):
        raise RayStarted

    monkeypatch.setattr(dataflow.driver.runtime, "start_ray", start_ray)
    assert main(["graphs/ppo.py", "--set", "learner.micro_batch_size=2", "--set", "learner.max_tokens_per_micro_batch=64",
                 "--set", "critic.micro_batch_size=2", "--set", "critic.max_tokens_per_micro_batch=64"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {node}.micro_batch_size=2 and {node}.max_tokens_per_micro_batch=64 both split the passes; set one "
        "of them to 0 (tokens bound memory whatever the lengths; rows are the older setting)"
        for node in ("critic", "learner")]
    assert main(["graphs/grpo.py", "--set", "learner.advantage=gae"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: learner.advantage=gae needs the critic's values: run graphs/ppo.py"), line
    with pytest.raises(RayStarted):  # settings that fit together: the run starts
        main(["graphs/grpo.py", "--set", "learner.schedule.decay=cosine", "--max-steps", "10"])


def test_share_rules_must_name_real_settings_at_import():
    """A typo in a share/fill rule of a graph config is an error when the class is defined, not a
    rule that fails (or silently does nothing) once a run resolves it."""
    from dataflow import fill, share
    from dataflow.config import ConfigError, rule_problems
    from graphs.rlhf import RLHFConfig

    for module in ("graphs.grpo", "graphs.dapo", "graphs.ppo"):
        cls = next(v for k, v in vars(__import__(module, fromlist=["x"])).items() if k.endswith("GraphConfig"))
        assert rule_problems(cls) == [], module
    with pytest.raises(ConfigError, match=r"Typo.rules: 'share prompts_per_step -> learner.prompt_per_step' names "
                                          r"'learner.prompt_per_step', but LearnerConfig has no setting 'prompt_per_step'"):
        @dataclass(kw_only=True)
        class Typo(RLHFConfig):
            rules: ClassVar[tuple] = RLHFConfig.rules + (share("prompts_per_step", "learner.prompt_per_step"),)
    with pytest.raises(ConfigError, match=r"names 'generator.sampling.top_k', but GeneratorConfig has no setting"):
        @dataclass(kw_only=True)
        class Nested(RLHFConfig):
            rules: ClassVar[tuple] = RLHFConfig.rules + (fill("generator.sampling.top_k", "max_staleness"),)
