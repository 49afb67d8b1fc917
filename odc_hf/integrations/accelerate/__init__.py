"""Accelerate: the FSDP plugin with ODC's options, the accelerator that installs ODC, the launch config's keys, the
HSDP mesh."""
