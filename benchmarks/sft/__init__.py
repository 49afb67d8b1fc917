"""Multi-GPU SFT: ODC against FSDP2 collectives end to end, trainer checks, FSDP parity, microbatch probes."""
