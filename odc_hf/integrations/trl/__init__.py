"""TRL with ODC: ODCSFTTrainer and ODCGRPOTrainer, their configs, the GRPO batch and metrics, ``patch_trl``."""
