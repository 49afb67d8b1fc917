"""The microbatch compute path: attention setup, activation checkpointing, the fused LM head and loss, the cost model
microbatches are planned with."""
