"""Synthetic Qwen3-MoE checkpoints (random weights, local tokenizer) for tests, demos and benchmarks."""
