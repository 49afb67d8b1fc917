"""Attention kernels and plans: exactness checks, kernel comparisons, the model-family sweep."""
