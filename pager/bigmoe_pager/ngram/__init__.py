"""The n-gram pager's core: Qwen4Exp n-gram tables read in place from checkpoint shards.

No vLLM here. `NgramTable` gathers rows (bytes) from the page cache or the SSD;
`dequant.dequantize_rows` and `prefetch.RowPrefetcher` (torch) move them to the
device; `adapters/vllm/ngram.py` hooks them into vLLM's Qwen4Exp PLE layer.
"""

from .errors import NgramError, NgramFileError, NgramLayoutError, NgramRangeError, NgramReadError
from .spec import TableSpec
from .table import NgramTable

__all__ = [
    "NgramError",
    "NgramFileError",
    "NgramLayoutError",
    "NgramRangeError",
    "NgramReadError",
    "NgramTable",
    "TableSpec",
]
