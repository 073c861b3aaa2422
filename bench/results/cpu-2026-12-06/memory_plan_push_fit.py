import json, os
from dataflow.driver.loading import load_graph
QWEN = {"0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
        "1.5b": dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=True),
        "3b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, intermediate_size=11008, tie_word_embeddings=True),
        "7b": dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False)}
for gib, size, lora in ((80, "0.5b", 32), (80, "1.5b", 0), (80, "3b", 32), (80, "3b", 0), (140, "3b", 0), (140, "7b", 32), (80, "7b", 32)):
    d = f"/tmp/q_{size}"; os.makedirs(d, exist_ok=True)
    json.dump({"model_type": "qwen2", "max_position_embeddings": 32768, **QWEN[size]}, open(d + "/config.json", "w"))
    sets = ["placement=colocated", f"gpu_memory_gib={gib}", "max_new_tokens=256", "prompts.max_prompt_tokens=128",
            "prompts_per_step=32", "group_size=8", "learner.minibatch_size=256", "learner.kl.coef=0.01", f"policy.path={d}", f"learner.lora.rank={lora}"]
    g, c = load_graph("graphs/grpo.py", sets)
    p = g.memory_plan
    print(gib, size, "lora" if lora else "full", "PROBLEM: " + p.problem if p.problem else p.summary())
