"""Benchmark: weights through Ray's object store, as pickled torch tensors (before) and as the
channel codec's numpy buffers (dataflow/weights/sync.encode_state, weight_transport=object_store).

    python bench/object_store_push.py                     SmolLM2-135M's shape, fp32 and bf16
    python bench/object_store_push.py --layers 2          a smaller model, quicker

The model is built from a Llama config with SmolLM2-135M-Instruct's shape (30 layers x 576, 49152
tokens, tied embeddings; random init, no download). Per dtype, the median of --iters of: put (the
learner's ray.put of the travel copies), get (a generator actor's fetch), and load (get, decode and
load_state_dict into the generator's model), both ways side by side in one Ray instance. The loaded
weights are checked bit for bit against the learner's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from dataflow.weights.sync import decode_state, encode_state  # noqa: E402


def model_config(layers: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)


@ray.remote
class Generator:
    def __init__(self, layers: int, dtype: str):
        self.model = LlamaForCausalLM(model_config(layers)).to(getattr(torch, dtype))

    def load(self, box: list, codec: bool) -> tuple[float, float]:
        """(get s, get + decode + load_state_dict s) of the weights in box[0]."""
        t0 = time.perf_counter()
        value = ray.get(box[0])
        t1 = time.perf_counter()
        self.model.load_state_dict(decode_state(value) if codec else value)
        return t1 - t0, time.perf_counter() - t0

    def checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.model.state_dict().values()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print("| dtype | way | put s | get s | get + load s | put + load: ratio |")
    print("|---|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(model_config(args.layers)).to(getattr(torch, dtype))
        params = sum(p.numel() for p in model.parameters())
        generator = Generator.remote(args.layers, dtype)
        medians = {}
        for codec in (False, True):
            puts, gets, loads = [], [], []
            for _ in range(args.iters):
                state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
                t0 = time.perf_counter()
                ref = ray.put(encode_state(state) if codec else state)
                puts.append(time.perf_counter() - t0)
                got, loaded = ray.get(generator.load.remote([ref], codec))
                gets.append(got)
                loads.append(loaded)
                del ref
            expect = float(sum(p.double().sum() for p in model.state_dict().values()))
            assert ray.get(generator.checksum.remote()) == expect, "the generator's weights differ"
            medians[codec] = [statistics.median(x) for x in (puts, gets, loads)]
        for codec in (False, True):
            put, get, load = medians[codec]
            way = "codec buffers" if codec else "torch pickle"
            print(f"| {dtype} ({params / 1e6:.0f}M) | {way} | {put:.3f} | {get:.3f} | {load:.3f} | "
                  f"{(medians[False][0] + medians[False][2]) / (put + load):.1f}x |")
    ray.shutdown()


if __name__ == "__main__":
    main()
