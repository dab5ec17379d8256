"""A byte-level BPE tokenizer trained here on a synthetic corpus, with Qwen's chat markers.

Nothing is downloaded: the corpus is made of invented words drawn from a seeded
random generator, and the `tokenizers` package trains the merges. The special
tokens sit at the top of the tokenizer's ids, as in Qwen's tokenizers.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Qwen's document end and chat-turn markers, in id order."""
MAX_TOKENIZER_VOCAB = 8192
"""Largest tokenizer trained; a model vocab beyond it keeps unused rows, as Qwen's configs do."""
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""Jinja chat template in Qwen's ChatML form."""


class TokenizerUnavailable(RuntimeError):
    """The `tokenizers` package is missing; the message is one line."""


def tokenizer_size(vocab: int) -> int:
    """Ids the tokenizer uses for a model of `vocab` rows."""
    return min(vocab, MAX_TOKENIZER_VOCAB)


def special_ids(vocab: int) -> dict[str, int]:
    """Id of each special token: the last ids of the tokenizer."""
    size = tokenizer_size(vocab)
    return {token: size - len(SPECIAL_TOKENS) + i for i, token in enumerate(SPECIAL_TOKENS)}


def synthetic_corpus(seed: int, words: int) -> list[str]:
    """Lines of invented prose, numbers and code-like text; the same for the same seed."""
    rng = random.Random(seed)
    onsets = [
        "",
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "br",
        "ch",
        "cr",
        "dr",
        "fl",
        "gr",
        "pl",
        "qu",
        "sh",
        "st",
        "th",
        "tr",
    ]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "rk"]
    lexicon = sorted(
        {
            "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 4)))
            for _ in range(max(words // 8, 64))
        }
    )
    # Zipf-like frequencies so common words merge into single tokens first.
    cumulative = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(lexicon))))
    lines = []
    remaining = words
    while remaining > 0:
        kind = rng.random()
        count = rng.randint(4, 16)
        drawn = rng.choices(lexicon, cum_weights=cumulative, k=count)
        if kind < 0.75:
            drawn[0] = drawn[0].capitalize()
            line = " ".join(drawn) + rng.choice([".", ".", "!", "?", ";"])
        elif kind < 0.9:
            line = " ".join(f"{w} {rng.randint(0, 9999)}" for w in drawn[: count // 2]) + "."
        else:
            line = f"def {drawn[0]}({', '.join(drawn[1:3])}):\n    return {drawn[3]}[{rng.randint(0, 99)}]"
        lines.append(line)
        remaining -= count
    return lines


def train(vocab: int, seed: int):
    """A trained `tokenizers.Tokenizer` of exactly tokenizer_size(vocab) ids."""
    try:
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    except ImportError:
        raise TokenizerUnavailable(
            "the tokenizers package is not installed; install it (pip install tokenizers) or pass --no-tokenizer"
        ) from None
    size = tokenizer_size(vocab)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(synthetic_corpus(seed, words=size * 40), trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    if tokenizer.get_vocab_size() != size:
        raise RuntimeError(f"the synthetic corpus yielded {tokenizer.get_vocab_size()} tokens, not {size}")
    return tokenizer


def tokenizer_config(vocab: int, max_length: int) -> dict:
    """tokenizer_config.json: fast tokenizer, ChatML template, eos <|im_end|>."""
    ids = special_ids(vocab)
    return {
        "added_tokens_decoder": {
            str(ids[token]): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token in SPECIAL_TOKENS
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


@functools.lru_cache(maxsize=8)
def trained_json(vocab: int, seed: int) -> str:
    """tokenizer.json text; training is deterministic, so one process trains each (vocab, seed) once."""
    return train(vocab, seed).to_str(pretty=True)


def write(directory: Path, vocab: int, seed: int, max_length: int) -> list[Path]:
    """Train the tokenizer and write tokenizer.json and tokenizer_config.json into `directory`."""
    paths = [directory / "tokenizer.json", directory / "tokenizer_config.json"]
    paths[0].write_text(trained_json(vocab, seed))
    paths[1].write_text(json.dumps(tokenizer_config(vocab, max_length), indent=2) + "\n")
    return paths
