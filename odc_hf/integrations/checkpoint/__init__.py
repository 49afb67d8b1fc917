"""Checkpoints of the ODC trainers: saving, loading, resuming from complete checkpoints only."""
