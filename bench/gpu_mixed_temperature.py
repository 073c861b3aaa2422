"""GPU check of per-request temperatures in the static decoder (validation: greedy rows beside sampled
ones): with CUDA graphs and the compiled sampler, each row equals a decoder run at its one temperature.
Run: python bench/gpu_mixed_temperature.py (CUDA). On an H200 (torch 2.11): llama and qwen2 both
"mismatches []", the mixed-mode graph captured, compiled sampler on."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rl.generation import decoding  # noqa: E402
from rl.model import causal_lm as models  # noqa: E402
from rl.data import tasks  # noqa: E402

assert __import__("torch").cuda.is_available(), "gpu_mixed_temperature needs a CUDA device"
tok = tasks.build_tokenizer()
for fam in ("llama", "qwen2"):
    policy = models.build_policy(models.ModelConfig(family=fam, n_layer=2, n_embd=64, n_head=4, n_kv_head=2), tok).eval().to("cuda")
    ps = [tok(r["prompt"])["input_ids"] for r in tasks.make_task("copy", 3, seed=0).take(24)]
    keys = [(i, 0) for i in range(len(ps))]
    kw = dict(num_slots=8, cuda_graphs=True)
    sampled = decoding.decode_responses(policy, tok, ps, 8, temperature=0.7, seed=2, keys=keys, top_k=10, **kw)
    greedy = decoding.decode_responses(policy, tok, ps, 8, temperature=0, seed=2, keys=keys, top_k=10, **kw)
    dec = decoding.StaticDecoder(policy, 8, 32, eos_id=tok.eos_token_id, max_new_tokens=8, temperature=0.7, top_k=10, seed=2, cuda_graphs=True)
    queue = [(p, i, decoding.sample_key(2, i, 0), 0.0 if i % 2 else None) for i, p in enumerate(ps)]
    out = {}
    while queue or dec.active:
        dec.add([queue.pop(0) for _ in range(min(dec.free_slots(), len(queue)))])
        out.update(dec.step())
    bad = [i for i in range(len(ps)) if out[i]["response_ids"] != (greedy if i % 2 else sampled)[i]["response_ids"]]
    modes = sorted({k[2] for k in dec._graphs})
    print(fam, "graphs", len(dec._graphs), "modes", modes, "compiled sampler", dec._compiled is not None, "mismatches", bad, flush=True)
    assert not bad and modes in ([True], [False, True]), (bad, modes)
print("OK")
