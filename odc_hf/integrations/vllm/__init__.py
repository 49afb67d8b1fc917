"""vLLM generation beside ODC: the colocated engine's weights, pushed from ODC's shards."""
