"""Benchmark-only models and tools: they measure and test the pager; vLLM never loads them.

moe_ref.py, moe_decode.py  reference and Triton MoE layers over slot buffers (the pager benchmark's models)
streaming.py               a step streamed through an ExpertPager's slots in chunks
bench_runners.py           the pager benchmark's runners
traces.py                  routing families, predictions, trace files, an LRU check
synth_experts.py           synthetic expert checkpoints for SSD-tier tests and benchmarks
codec_samples.py           FP8 expert samples for the codec's tests and benchmark
ngram_synthetic.py         synthetic n-gram tables in the checkpoint's layout

scripts/ holds the command lines over these (run with PYTHONPATH=pager:app:bench from a checkout).
"""
