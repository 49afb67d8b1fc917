"""How processes start and end: the examples' relaunch, a rank's error report, the shared-GPU mode, the CUDA
allocator's environment, the gloo exit guard."""
