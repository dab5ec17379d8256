"""The smallest Qwen4Exp shape the unit tests write checkpoints of (a few MB; add `layers=`): every block of the
architecture once, FP8 blocks of 128, the n-gram table in three parts. Shared so the tests agree on one shape."""

TINY_QWEN4EXP = dict(
    experts=12,
    top_k=4,
    hidden=128,
    moe_intermediate=128,
    shared_intermediate=128,
    vocab=1024,
    heads=2,
    kv_heads=1,
    head_dim=128,
    linear_key_heads=1,
    linear_value_heads=2,
    linear_head_dim=128,
    hc_count=2,
    hc_lowrank=16,
    indexer_heads=1,
    indexer_head_dim=64,
    indexer_budget=64,
    ngram_vocab_base=1024,
    ngram_parts=3,
    max_position=4096,
)
