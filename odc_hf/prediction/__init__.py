"""Prediction: what a training run would cost, before it runs. Nothing here runs in training (the trainers import
none of it, ``tests/project/test_layering.py`` checks), and nothing here imports the trainers.

- :mod:`.workloads`: seeded sample-length generators of the workloads the ODC paper evaluates, Qwen2.5 shapes;
- :mod:`.calibrate`: times a model's forward + backward on the target device and fits a cost model in seconds;
- :mod:`.cost_models`: cost models in seconds: the shipped H200 calibration, a user's JSON, scaled by FLOPs;
- :mod:`.cluster`: what crosses the network between nodes for ODC-HSDP, FSDP2-HSDP and FSDP2 full sharding;
- :mod:`.lockstep`: prices a lockstep plan built elsewhere (padded or packed microbatches);
- :mod:`.batch_rebalance`: transformers' ``batch_rebalance`` sampler run as a plain planner;
- :mod:`.simulate`: plans every step with the planners of :mod:`odc_hf.balance` and prices it on a cluster;
- :mod:`.estimate`, :mod:`.estimate_inputs`, :mod:`.estimate_cli`: ``python -m odc_hf.estimate``.

This ``__init__`` imports nothing (the command's ``--help`` stays fast): import the modules themselves.
"""
