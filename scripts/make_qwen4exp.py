"""Make a synthetic Qwen4Exp (Qwen3.8-Flash-Next architecture) checkpoint (code: bigmoe.model.tinymoe.qwen4exp).

    python scripts/make_qwen4exp.py OUT --layers 4 --dtype fp8 --device cuda [--experts 512] ...

Runs from a checkout without installing (the H200 has no bigmoe install): app/,
pager/ and bench/ (the n-gram table's synthetic rows) are put on the path.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "app"), str(ROOT / "pager"), str(ROOT / "bench")]

from bigmoe.model.tinymoe.qwen4exp import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
