"""Synthetic MoE expert checkpoints (the code lives in bigmoe_bench.synth_experts).

PYTHONPATH=pager:bench python scripts/synth_experts.py DIR --hidden 2048 --intermediate 512 --layers 2 --experts 64
"""

import sys

from bigmoe_bench.synth_experts import main

if __name__ == "__main__":
    sys.exit(main())
