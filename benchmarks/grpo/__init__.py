"""GRPO: the end-to-end benchmark and TRL's GRPOTrainer + vLLM colocate against ODCGRPOTrainer."""
