"""Make a synthetic Qwen3-MoE checkpoint (the code lives in bigmoe.model.tinymoe.make).

    python scripts/make_tiny_moe.py OUT --layers N --experts E --top-k K --hidden H \
        --moe-intermediate I --dtype fp8|bf16 --seed S [--vocab V] [--device cuda] ...

Runs from a checkout without installing (the H200 has no bigmoe install) and is
importable by tests: every public name of bigmoe.model.tinymoe.make is here too.
"""

import sys
from pathlib import Path

for part in ("app", "pager"):  # runs from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / part))

from bigmoe.model.tinymoe.make import *  # noqa: E402,F401,F403
from bigmoe.model.tinymoe.make import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
