"""Transports: primitive latencies and ranks sharing one GPU."""
