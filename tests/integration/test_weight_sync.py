"""weight_transport=collective (dataflow/weights/sync.py) on CPU, gloo: first the two ends in one
process with stand-in node contexts (rendezvous, the wait for a version, checksums, a stall); then
GRPO graph runs: a stalled push failing the run, and a Qwen3 model dir whose weights reach two
generators by the collective push. The same check on the object store: tests/integration/test_multinode.py's
two-generator run; a generator killed under the collective push: tests/integration/test_multirank.py's
tp=2 run. One Ray instance for the graph runs, which go through runtime.run_graph in-process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


from dataflow.errors import NodeFailed, UserError  # noqa: E402
from dataflow.weights.hybrid_engine import WeightPushError  # noqa: E402
from dataflow.driver.runtime import RunOptions, load_graph, run_graph  # noqa: E402
from rl.model.causal_lm import ModelConfig, build_policy  # noqa: E402
from rl.data.tasks import build_tokenizer  # noqa: E402
from dataflow.weights import ipc as weight_ipc  # noqa: E402
from dataflow.weights.state import state_bytes, travel_copy, unique_state  # noqa: E402
from dataflow.weights.ipc import (flat_layout, ipc_state_split, pack_state, seqlock_consistent,  # noqa: E402
                                  stage_copy, unpack_state)
from dataflow.weights.sync import (SYNC_EDGE, GeneratorWeightSync, LearnerWeightSync,  # noqa: E402
                                   WeightSyncConfig, weights_checksum)

ROOT = Path(__file__).resolve().parents[2]
SMALL = ("prompts_per_step=32", "channel_capacity=16", "critic.minibatch_size=32", "learner.minibatch_size=32")
GENERATORS = ("generator[0]", "generator[1]")


# ---- both ends in one process -----------------------------------------------------------------
class Edges:
    """The versioned edges between one learner and its generators (what NodeHost does over Ray)."""

    def __init__(self):
        self.values: dict[str, tuple[int, object]] = {}
        self.changed = asyncio.Condition()


class StandInContext:
    """The part of NodeContext that dataflow/weights/sync.py and ipc.py use."""

    def __init__(self, edges: Edges, name: str, replica: int = 0, num_replicas: int = 1,
                 subscribers: tuple[str, ...] = ()):
        self.edges, self.name, self.replica, self._subscribers = edges, name, replica, list(subscribers)
        self.full_name = f"{name}[{replica}]" if num_replicas > 1 else name
        self.device = "cpu"
        self.logged: list[dict] = []

    def subscribers(self, edge: str) -> list[str]:
        return self._subscribers if edge == SYNC_EDGE else []

    async def publish(self, edge: str, value, version: int) -> None:
        async with self.edges.changed:
            self.edges.values[edge] = (version, value)
            self.edges.changed.notify_all()

    def latest_version(self, edge: str) -> int:
        return self.edges.values.get(edge, (-1, None))[0]

    async def latest(self, edge: str):
        return self.edges.values.get(edge, (-1, None))

    async def wait_version(self, edge: str, min_version: int) -> int:
        async with self.edges.changed:
            await self.edges.changed.wait_for(lambda: self.latest_version(edge) >= min_version)
        return self.latest_version(edge)

    def span(self, name: str, **args):
        return contextlib.nullcontext()

    def metrics(self, values: dict) -> None:
        self.logged.append(values)

    def log(self, text: str) -> None:
        pass


def tiny_policy(seed: int):
    return build_policy(ModelConfig(n_layer=1, n_embd=32, n_head=2, intermediate_size=64, seed=seed),
                        build_tokenizer())


def checksums(records: list[dict]) -> list[dict]:
    """The checksum keys of the learner's push records (each also carries the push's cost)."""
    return [{k: r[k] for k in ("weights/version", "weights/checksum")} for r in records]


def test_collective_sync_in_one_process():
    """Rendezvous in the setups; a generator asking for weights before the first push waits for
    version 0 (then serves the learner's weights, not its own different init); versions pushed
    back to back are served newest first; a generator that stops receiving makes the learner's
    publish fail within its timeout, naming both ends."""
    async def scenario():
        edges = Edges()
        names = ("generator[0]", "generator[1]")
        cfg = WeightSyncConfig(transport="collective", timeout_s=2, rendezvous_timeout_s=30, checksums=True)
        lctx = StandInContext(edges, "learner", subscribers=names)
        gctx = [StandInContext(edges, "generator", i, 2) for i in range(2)]
        learner, gens = LearnerWeightSync(lctx, cfg), [GeneratorWeightSync(c, cfg) for c in gctx]
        model = tiny_policy(seed=0)
        await asyncio.gather(learner.setup(model), *(g.setup(tiny_policy(seed=1)) for g in gens))

        async def serve(g):
            async with g.serving() as version:
                return version, weights_checksum(g.model)

        waiting = [asyncio.ensure_future(serve(g)) for g in gens]
        await asyncio.sleep(0.3)
        assert not any(w.done() for w in waiting), "served before the first push"
        await learner.publish(model, 0)
        want = {0: weights_checksum(model)}
        assert [await w for w in waiting] == [(0, want[0])] * 2
        for version in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * version)
            await learner.publish(model, version)
            want[version] = weights_checksum(model)
        assert [await serve(g) for g in gens] == [(2, want[2])] * 2
        assert checksums(lctx.logged) == [{"weights/version": v, "weights/checksum": c} for v, c in want.items()]
        # each push's cost in the same record: the whole float32 state dict travelled over the collective,
        # each tensor once (the tied lm_head is the embedding), in the push's arena: every tensor at
        # a 256-byte aligned offset (dataflow/weights/hybrid_engine.py)
        unique = unique_state(model.state_dict())[0]
        whole = sum(v.numel() * 4 for v in unique.values())
        assert whole < sum(v.numel() * 4 for v in model.state_dict().values())
        assert [(e["weights/pushed_version"], e["weights/push_adapter"]) for e in lctx.logged] == [(v, False) for v in want]
        assert all(whole <= e["weights/push_mib"] * 2**20 < whole + 256 * len(unique) for e in lctx.logged), lctx.logged
        assert all(e["weights/push_s"] > 0 for e in lctx.logged)
        assert [e["weights/version"] for e in gctx[0].logged] == [0, 2]     # switched to 0, then 2

        stuck = gens[1].receiver._arena_lock
        stuck.acquire()                  # generator[1]'s receive thread waits here from now on
        try:
            with pytest.raises(WeightPushError, match=r"v3 from learner to generator\[0\], generator\[1\].*"
                               r"stalled past 2 s"):
                await learner.publish(model, 3)
        finally:
            stuck.release()
        assert lctx.latest_version("policy") == 2     # a failed push announces nothing

    asyncio.run(asyncio.wait_for(scenario(), 120))


# ---- cuda_ipc on CPU: the error, the flat buffer, the seqlock, both ends with CPU stand-ins ------
def test_object_store_weights_travel_in_the_generators_dtype():
    """The graph fills in the dtype the weights travel in from the generators' (auto: bfloat16 on
    GPUs, fp32 on CPU), and the learner casts floating-point tensors to it before the copy to the
    object store (half the bytes of fp32 masters); integer buffers travel as they are."""
    cfg = lambda *o: load_graph(str(ROOT / "graphs/ppo.py"), list(o))[1].learner.weight_sync  # noqa: E731
    assert cfg().dtype == "float32"
    assert cfg("placement=colocated", "num_gpus=1").dtype == "bfloat16"
    assert cfg("placement=colocated", "num_gpus=1", "generator.dtype=float16").dtype == "float16"
    assert cfg("learner.weight_sync.dtype=float32", "placement=colocated", "num_gpus=1").dtype == "float32"
    weights = torch.randn(3, 4)
    sent = travel_copy(weights, torch.bfloat16)
    assert sent.dtype == torch.bfloat16 and torch.equal(sent, weights.to(torch.bfloat16))
    assert travel_copy(torch.arange(3), torch.bfloat16).dtype == torch.int64
    assert travel_copy(weights, None).dtype == torch.float32


def test_cuda_ipc_on_cpu_fails_naming_the_setting():
    async def scenario():
        edges, cfg = Edges(), WeightSyncConfig(transport="cuda_ipc")
        with pytest.raises(UserError, match=r"weight_transport=cuda_ipc needs CUDA, but learner runs on cpu"):
            await LearnerWeightSync(StandInContext(edges, "learner"), cfg).setup(tiny_policy(seed=0))
        with pytest.raises(UserError, match=r"weight_transport=cuda_ipc needs CUDA, but generator runs on cpu"):
            await GeneratorWeightSync(StandInContext(edges, "generator"), cfg).setup(tiny_policy(seed=0))

    asyncio.run(scenario())


def test_flat_buffer_pack_unpack_is_bit_exact():
    g = torch.Generator().manual_seed(0)
    shapes = {"scalar": (), "empty": (0, 3), "vec": (5,), "mat": (7, 3), "cube": (2, 3, 4), "long": (300,)}
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    state["vec"][:3] = torch.tensor([float("inf"), -0.0, float("nan")])
    layout, total = flat_layout({k: v.shape for k, v in state.items()}, align=128)
    assert [n for n, _, _ in layout] == list(shapes)
    ends = [(off, off + torch.Size(s).numel()) for _, off, s in layout]
    assert all(off % 128 == 0 for off, _ in ends) and all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))
    assert total >= ends[-1][1] and total % 128 == 0
    flat = torch.full((total,), 7.0)
    pack_state(flat, layout, state)
    back = unpack_state(flat, layout)
    for k, v in state.items():
        assert back[k].shape == v.shape and (back[k].data_ptr() != v.data_ptr() or not v.numel())
        assert torch.equal(back[k].view(torch.int32), v.view(torch.int32)), k    # bit exact (nan, -0.0)
    assert unpack_state(flat, layout)["mat"].data_ptr() == flat[layout[3][1]:].data_ptr()   # views, no copy
    bf = torch.zeros(total, dtype=torch.bfloat16)             # the cast: as .to(bfloat16)
    pack_state(bf, layout, state)
    for k, v in unpack_state(bf, layout).items():
        assert torch.equal(v.view(torch.int16), state[k].to(torch.bfloat16).view(torch.int16)), k
    shapes_, extra = ipc_state_split({"w": torch.ones(2), "steps": torch.tensor([3])})
    assert shapes_ == {"w": (2,)} and list(extra) == ["steps"]


class ScriptedHeader:
    """A seqlock header whose reads return the given values in turn (a learner writing meanwhile)."""

    def __init__(self, *values):
        self.values = list(values)

    def item(self):
        return self.values.pop(0)


def test_seqlock_copy_keeps_only_whole_versions():
    assert seqlock_consistent(4, 4, 4)
    assert not seqlock_consistent(4, -1, 4) and not seqlock_consistent(4, 4, -1)
    assert not seqlock_consistent(4, 4, 6) and not seqlock_consistent(4, 2, 2)
    buffer, staging = torch.arange(8.0), torch.zeros(8)
    assert stage_copy(staging, buffer, torch.tensor([4]), 4) == (True, 4, 4)
    assert torch.equal(staging, buffer)
    staging.zero_()
    assert stage_copy(staging, buffer, ScriptedHeader(-1), 4) == (False, -1, -1)   # being written: no copy
    assert stage_copy(staging, buffer, ScriptedHeader(6), 4) == (False, 6, 6)      # already the next one
    assert not staging.any()
    assert stage_copy(staging, buffer, ScriptedHeader(4, -1), 4) == (False, 4, -1)  # overwritten meanwhile
    assert stage_copy(staging, buffer, ScriptedHeader(4, 6), 4) == (False, 4, 6)


def test_cuda_ipc_both_ends_with_cpu_stand_ins(monkeypatch):
    """The cuda_ipc logic with the CUDA parts stood in on CPU (buffers on CPU, a handle = a registry
    key): versions alternate between two buffers, a generator stages at receipt and switches only in
    serving(), serves the learner's weights cast to weight_sync.dtype (equal checksums), drops a version the
    learner overwrote before the copy (and then times out waiting for it), and a generator on another
    GPU fails naming the setting."""
    shared: dict[int, torch.Tensor] = {}

    def rebuild(storage_handle, storage_offset_bytes, tensor_offset, tensor_size, storage_device):
        assert storage_device == 0
        return shared[storage_handle]

    def share(t):
        shared[id(t)] = t
        return rebuild, (id(t), 0, 0, tuple(t.shape), "learner's device")

    for name, value in (("require_cuda", lambda device, who: None), ("device_index", lambda: 0),
                        ("ipc_device", lambda index: torch.device("cpu")), ("share", share),
                        ("gpu_uuid", lambda index: "GPU-0")):
        monkeypatch.setattr(weight_ipc, name, value)

    async def scenario():
        edges = Edges()
        cfg = WeightSyncConfig(transport="cuda_ipc", checksums=True, timeout_s=0.5)
        lctx, gctx = StandInContext(edges, "learner"), StandInContext(edges, "generator")
        learner, gen = LearnerWeightSync(lctx, cfg), GeneratorWeightSync(gctx, cfg)
        model = tiny_policy(seed=0)
        await learner.setup(model)
        await gen.setup(tiny_policy(seed=0))     # the shared seed: version 0
        # The tied lm_head takes no place of its own in the buffers: its name rides as an alias.
        unique, aliases = unique_state(model.state_dict())
        assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
        assert learner.ipc["aliases"] == aliases and [n for n, _, _ in learner.ipc["layout"]] == list(unique)

        async def serve():
            async with gen.serving() as version:
                return version, weights_checksum(gen.model)

        await learner.publish(model, 0)
        await asyncio.sleep(0.05)
        assert (await serve())[0] == 0 and gen.ipc.staged == -1     # v0 is the seed's: nothing staged
        want = {}
        for version in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * version)
            await learner.publish(model, version)
            want[version] = weights_checksum(model, torch.bfloat16)
            await asyncio.sleep(0.05)
            assert gen.ipc.staged == version and gen.version == 0   # staged at receipt, not switched yet
        assert learner.ipc["headers"][0].item() == 2 and learner.ipc["headers"][1].item() == 1
        assert await serve() == (2, want[2])
        for (k, v), (k2, v2) in zip(model.state_dict().items(), gen.model.state_dict().items()):
            assert k == k2 and torch.equal(v2, v.to(torch.bfloat16).float()), k
        assert [e["weights/version"] for e in gctx.logged] == [2]
        assert checksums(lctx.logged[1:]) == [{"weights/version": v, "weights/checksum": c} for v, c in want.items()]
        assert [e["weights/pushed_version"] for e in lctx.logged[1:]] == list(want)
        assert {e["weights/push_mib"] * 2**20 for e in lctx.logged} == {state_bytes(unique, torch.bfloat16)}

        learner.config = WeightSyncConfig(transport="cuda_ipc")   # publish now returns before the receipt
        await learner.publish(model, 3)
        learner.ipc["headers"][1].fill_(5)      # the learner began v5 before the generator copied v3
        await asyncio.sleep(0.05)
        assert gen.ipc.staged == 2
        with pytest.raises(RuntimeError, match=r"weights v3 not staged .* within 0.5 s"):
            await serve()
        for version in (4, 5):
            await learner.publish(model, version)
        await asyncio.sleep(0.05)
        assert (await serve())[0] == 5

        other = GeneratorWeightSync(StandInContext(edges, "generator", 1, 2), cfg)
        monkeypatch.setattr(weight_ipc.IpcReceiver, "uuid", lambda self: "GPU-1")
        await other.setup(tiny_policy(seed=0))
        await asyncio.sleep(0.05)
        with pytest.raises(UserError, match=r"weight_transport=cuda_ipc needs every generator on the "
                                            r"learner's GPU; use object_store or collective"):
            await asyncio.wait_for(other.serving().__aenter__(), 5)

    asyncio.run(asyncio.wait_for(scenario(), 60))


# ---- the PPO graph -----------------------------------------------------------------------------


def run(graph_file: str, tmp_path: Path, *overrides: str, max_steps: int) -> list[dict]:
    graph, config = load_graph(str(ROOT / graph_file), list(overrides))
    options = RunOptions(max_steps=max_steps, out_dir=str(tmp_path), quiet=True)
    summary = asyncio.run(run_graph(graph, options, config))
    assert summary.status in ("done", "max steps reached"), summary.status
    return [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]


def check_generators_serve_the_learners_weights(records: list[dict], transport: str, state: dict) -> None:
    """Synchronous GRPO (batch k is generated at version k), 2 generators, 3 steps: steps and versions
    progress alike, and every version a generator switched to has the checksum the learner logged for
    it, up to the last version pushed (2: step 3 ends the run). Each push carried the whole `state`
    (the model's state dict) in float32 (CPU's travel dtype), each tensor once: a tied lm_head does not
    travel a second time (the generators still hold the learner's exact weights, lm_head included, so
    it was re-tied on arrival)."""
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert all(r["staleness/max"] == 0 for r in steps)
    sums: dict[str, dict[int, float]] = {}
    for r in records:
        if "weights/checksum" in r:
            sums.setdefault(r["node"], {})[r["weights/version"]] = r["weights/checksum"]
    learner = sums.pop("learner")
    assert sorted(learner) == [0, 1, 2]
    assert len(set(learner.values())) == 3, "the weights should change at every version"
    assert set(sums) == set(GENERATORS), "both generators should have switched weights"
    for gen, got in sums.items():
        for version, checksum in got.items():
            assert checksum == pytest.approx(learner[version], rel=1e-12, abs=0), (gen, version)
    served = set().union(*sums.values())
    # Object store: version 0 is the shared seed's (no switch); collective: pushed like the others.
    assert served == ({0, 1, 2} if transport == "collective" else {1, 2})
    unique, aliases = unique_state(state)
    assert aliases, "the model's lm_head should be tied to its embeddings"
    whole = sum(v.numel() * 4 for v in unique.values())
    pad = 256 * len(unique) if transport == "collective" else 1    # the collective's aligned arena
    pushes = [r for r in records if "weights/push_s" in r]
    assert [r["weights/pushed_version"] for r in pushes] == [0, 1, 2]
    assert all(whole <= r["weights/push_mib"] * 2**20 < whole + pad and not r["weights/push_adapter"]
               for r in pushes), pushes


def test_stalled_push_fails_the_learner_naming_both_ends(ray_instance, tmp_path):
    """generator[1] never takes the push: the learner's push times out (2 s) and the run fails
    with the learner's WeightPushError, naming the learner and the generators."""
    with pytest.raises(NodeFailed) as failed:
        run("tests/graphs/stalled_push.py", tmp_path, "learner.weight_sync.timeout_s=2",
            "generator.weight_sync.timeout_s=60", max_steps=2)
    e = failed.value
    assert e.node == "learner", str(e)
    assert "WeightPushError" in e.summary and "stalled" in e.summary, e.summary
    assert "from learner to generator[0], generator[1]" in e.summary, e.summary


def test_a_qwen3_model_dir_trains_and_its_weights_reach_the_generators_by_collective(ray_instance, tmp_path):
    """A family with no fused adapter and no static decoder (Qwen3: q/k norms), as a user's model
    dir (its lm_head tied to the embeddings): GRPO runs on it with the HF generation loop (and a
    reference node), and every version the collective push delivers to either of 2 generators has
    the learner's checksum (the push carries the model's own names):
    check_generators_serve_the_learners_weights on the collective transport. (One run for both: a
    graph start-up less than a run of each.)"""
    import transformers

    from tests.chat_model import chat_tokenizer

    tok = chat_tokenizer()
    config = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                      max_position_embeddings=128, eos_token_id=tok.eos_token_id,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(tmp_path / "qwen3")
    tok.save_pretrained(tmp_path / "qwen3")
    rows = [{"prompt": [{"role": "user", "content": f"add {a} + {b} ="}], "answer": str(a + b)}
            for a in range(4) for b in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = run("graphs/grpo.py", tmp_path / "run", f"policy.path={tmp_path / 'qwen3'}",
                  f"prompts.path={tmp_path / 'train.jsonl'}", f"reward.path={ROOT / 'examples/smollm2_arithmetic/last_number_reward.py'}",
                  "reward.function=last_number_reward", "max_new_tokens=8", "prompts_per_step=4", "group_size=2",
                  "channel_capacity=16", "learner.minibatch_size=8", "generator_replicas=2", "max_staleness=0",
                  "weight_transport=collective", "weight_checksums=true", max_steps=3)
    check_generators_serve_the_learners_weights(records, "collective", model.state_dict())
