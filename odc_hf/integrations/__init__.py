"""The Hugging Face integration, in rooms, each one concept (lower rooms first; a room imports only lower ones):

- ``upstream``: every private name of transformers, TRL, accelerate and vLLM odc_hf uses, behind one fence;
- ``launch``: how processes start and end (relaunch, a rank's error report, the shared-GPU mode, the CUDA allocator);
- ``models``: what a model family's definition asks of packed training, and the behavioural check;
- ``checkpoint``: saving, loading and resuming;
- ``vllm``: the colocated vLLM engine's weights;
- ``accelerate``: ``ODCFSDPPlugin`` and ``ODCAccelerator``;
- ``compute``: attention setup, activation checkpointing, the fused LM head, the cost model;
- ``trainer``: ``ODCTrainer`` / ``ODCMixin`` and its parts;
- ``trl``: ``ODCSFTTrainer``, ``ODCGRPOTrainer``, their configs, ``patch_trl``.
"""
