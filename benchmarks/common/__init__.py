"""What the benchmarks share: the report writer (environment, commit, tables) and the SFT benchmark setup."""
