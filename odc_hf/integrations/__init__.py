"""Hugging Face integration: Accelerate (ODCAccelerator), transformers Trainer (ODCTrainer), TRL (ODCSFTTrainer)."""
