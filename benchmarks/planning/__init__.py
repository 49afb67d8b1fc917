"""Planning and prediction: the simulator, multi-node and rebalance studies, planner speed, calibration."""
