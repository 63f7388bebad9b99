#!/usr/bin/env python
"""Run the benchmark suite; the same code as ``qeff-evs bench`` (arguments are passed through).

    python benchmarks/run_bench.py -o benchmarks/results          # full run (many minutes)
    python benchmarks/run_bench.py --quick -o /tmp/bench_quick     # under two minutes
"""

import sys

from qeff_evs.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
