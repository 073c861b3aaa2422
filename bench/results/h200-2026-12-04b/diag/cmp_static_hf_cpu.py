"""Teacher-force two calculator demonstrations' first 8 response tokens through the static decoder
and HF's model, in fp32 and bf16, and print the log-probs of those tokens (CPU, no CUDA graphs).

    python bench/results/h200-2026-12-04b/diag/cmp_static_hf_cpu.py WARM_MODEL DATA/calculator/val.jsonl
"""
import asyncio
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT / "examples" / "agents"), str(ROOT)]
import judge as J  # noqa: E402
import warm_start as W  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rl.generation.decoder_forward import teacher_forced_logits  # noqa: E402
from rl.generation.decoding import StaticDecoder  # noqa: E402

model_dir, val = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(model_dir)
demos = asyncio.run(W.demonstrations(tok, J.read_rows(val, 2)))
for dt in (torch.float32, torch.bfloat16):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).eval()
    dec = StaticDecoder(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).eval(), 2, 1024,
                        eos_id=tok.eos_token_id, max_new_tokens=64, cuda_graphs=False)
    for ids, mask in demos:
        p = mask.index(1)
        prompt, cont = ids[:p], ids[p:p + 8]
        with torch.no_grad():
            h = hf(input_ids=torch.tensor([ids[:p + 8]])).logits[0, p - 1:p + 7].float().log_softmax(-1)
        s = teacher_forced_logits(dec, [prompt], [cont])[0].log_softmax(-1)
        print(dt, "prompt", p, "tokens", tok.convert_ids_to_tokens(cont[:4]))
        print("  HF  logp", [round(h[i, c].item(), 3) for i, c in enumerate(cont)])
        print("  dec logp", [round(s[i, c].item(), 3) for i, c in enumerate(cont)])
