"""What a run reads: prompt datasets (JSONL, JSON, parquet, token files), the built-in tasks and their
tokenizer, and the policy spec (where a policy comes from)."""
