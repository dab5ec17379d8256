"""Routing traces for the paging benchmark (the code lives in bigmoe_bench.traces).

    PYTHONPATH=pager:bench python scripts/traces.py --family topic-shift --layers 40 --experts 256 --k 8 --check 32,102
    PYTHONPATH=pager:bench python scripts/traces.py --family standard --layers 40 --recall 0.8 \
        --precision 0.5 --out t.npz

Scripts beside it that `import traces` get every public name of bigmoe_bench.traces.
"""

import sys

from bigmoe_bench.traces import *  # noqa: F401,F403
from bigmoe_bench.traces import main

if __name__ == "__main__":
    sys.exit(main())
