"""The command lines in a process of their own, as a user runs them: dataflow.run's user errors,
--describe and --help (the graph rules themselves: tests/unit/test_graph.py, in-process),
`python -m dataflow.trace` (tests/unit/test_trace.py), and a node actor's process that imports torch
only when a tensor arrives (tests/unit/test_codec.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from dataflow.channel.codec import Message, encode
from tests.unit.test_trace import _run_traced

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dataflow.run", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_user_errors_are_short_and_exit_2(tmp_path, capsys):
    """The first case through a real `python -m dataflow.run` process (its exit status); the others
    through dataflow.run.main in this process (the same code and exit status, without ~2.5 s of
    imports per case: see tests/integration/test_runtime.py's `main`)."""
    from dataflow import run as cli

    broken = tmp_path / "broken.py"
    broken.write_text("from dataflow import Graph\n\ngraph = Graph(\n  'x'\nx = 1\n")
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    cases = [
        (["tests/graphs/squares.py", "--set", "square.fail_onn=3"], "unknown setting 'square.fail_onn'"),
        (["tests/graphs/squares.py", "--set", "capacity=lots"], "--set capacity=lots: expected an integer"),
        (["tests/graphs/squares.py", "--set", "capacity=0"], "channel 'numbers': capacity must be an integer >= 1"),
        ([str(broken)], f"{broken}:3: syntax error"),
        ([str(empty)], "defines neither `build(config) -> Graph` nor `graph = Graph(...)`"),
        (["no/such/graph.py"], "no/such/graph.py: no such graph file"),
    ]
    r = run_cli(*cases[0][0])
    assert r.returncode == 2, (cases[0][0], r.stderr)
    assert cases[0][1] in r.stderr and "Traceback" not in r.stderr, r.stderr
    for args, expected in cases[1:]:
        capsys.readouterr()
        rc = cli.main([str(ROOT / a) if a.startswith("tests/") else a for a in args])
        err = capsys.readouterr().err
        assert rc == 2, (args, err)
        assert expected in err, (args, err)
        assert "Traceback" not in err, err


def test_cli_describe_lists_nodes_channels_placement_settings():
    r = run_cli("tests/graphs/squares.py", "--describe", "--set", "square_replicas=3")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "square" in out and "replicas=3" in out
    assert "numbers" in out and "capacity=4" in out
    assert "placement:" in out and "5 bundles" in out
    assert "counter.count = 20" in out


def test_cli_help_is_complete():
    r = run_cli("--help")
    for flag in ("--set", "--address", "--keep-processes", "--max-steps", "--describe", "--trace", "--out"):
        assert flag in r.stdout


def test_cli_prints_report_and_plots(tmp_path):
    collector, path = _run_traced(tmp_path)
    png = tmp_path / "trace.png"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "dataflow.trace", str(path), "--plot", str(png)],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert collector.report() in out.stdout          # the same table as at the end of the run
    assert "generator" in out.stdout and "wait-in" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "dataflow.trace", str(tmp_path / "missing.json")],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert bad.returncode == 2 and "error" in bad.stderr


def test_torch_is_imported_only_when_a_tensor_arrives(tmp_path):
    """A node host whose node and items hold no tensors never imports torch (its actor process
    starts ~2 s of CPU sooner: dataflow/actor/host.py), nor do the modules of the prompts, reward and
    filter nodes, and a tensor sent to a process without torch imports it on decode, bit-exact."""
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    sent = {"t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "a": np.arange(3), "s": "x"}
    (tmp_path / "item.pkl").write_bytes(pickle.dumps(encode(Message(sent, {"seq": 1}))))
    script = f"""if True:
        import pickle, sys
        import numpy as np
        from dataflow.channel.codec import Message, decode, encode
        from dataflow.actor.host import HostSpec, NodeHost
        from tests.graphs.toy import Counter, CounterConfig
        import nodes.group_filter, nodes.prompts, nodes.reward  # the nodes of a real graph without a model
        spec = HostSpec(node="c", replica=0, num_replicas=1, kind=Counter, config=CounterConfig(), cpus=1,
                        gpus=0, max_steps=None, trace=False, run_dir={str(tmp_path)!r})
        NodeHost(spec)
        plain = decode(*encode(Message({{"a": np.arange(3), "n": [1, 2.5, None]}}, {{"seq": 1}})))
        assert plain.data["a"].tolist() == [0, 1, 2] and plain.data["n"] == [1, 2.5, None]
        assert "torch" not in sys.modules, "imported torch without a tensor"
        got = decode(*pickle.loads(open({str(tmp_path / "item.pkl")!r}, "rb").read())).data
        import torch
        assert got["t"].dtype == torch.bfloat16 and got["t"].tolist() == [[0, 1, 2], [3, 4, 5]], got
        assert got["a"].tolist() == [0, 1, 2] and got["s"] == "x"
        """
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
