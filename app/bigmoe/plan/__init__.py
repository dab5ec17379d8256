"""The plan: where every expert lives and the exact vLLM command (planner.plan is the one estimator)."""
