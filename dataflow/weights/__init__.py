"""Weight movement: training layouts (FSDP2 x TP), resharding, the HybridEngine push, transports,
per-model weight adapters, the learner/generator sync ends and multi-rank nodes."""
