import asyncio, json, sys, torch
sys.path.insert(0, "/work/main/examples/agents"); sys.path.insert(0, "/work/main")
import warm_start as W, judge as J
from transformers import AutoModelForCausalLM, AutoTokenizer
from rl.generation.decoding import StaticDecoder
from rl.generation.decoder_forward import teacher_forced_logits
tok = AutoTokenizer.from_pretrained("/tmp/warm16")
rows = J.read_rows("/tmp/real/agent_data/calculator/val.jsonl", 4)
demos = asyncio.run(W.demonstrations(tok, rows))
for dt in (torch.float32, torch.bfloat16):
    hf = AutoModelForCausalLM.from_pretrained("/tmp/warm16", dtype=dt).eval()
    sd_model = AutoModelForCausalLM.from_pretrained("/tmp/warm16", dtype=torch.float32).to(dtype=dt).eval()
    dec = StaticDecoder(sd_model, 4, 1024, eos_id=tok.eos_token_id, max_new_tokens=64, cuda_graphs=False)
    for ids, mask in demos[:2]:
        p = mask.index(1); prompt, cont = ids[:p], ids[p:p + 8]
        with torch.no_grad():
            h = hf(input_ids=torch.tensor([ids[:p + 8]])).logits[0, p - 1:p + 7].float().log_softmax(-1)
        s = teacher_forced_logits(dec, [prompt], [cont])[0].log_softmax(-1)
        print(dt, "prompt", p, "demo tokens", tok.convert_ids_to_tokens(cont[:4]))
        print("  HF  logp", [round(h[i, c].item(), 3) for i, c in enumerate(cont)])
        print("  dec logp", [round(s[i, c].item(), 3) for i, c in enumerate(cont)])
