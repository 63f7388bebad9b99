"""``qeff-evs bench``: pruning sweep, window sweep, EVS overhead (issue 6). Owned by the bench work."""

from __future__ import annotations

import argparse


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smoke-sized run (under 2 minutes)")
    parser.add_argument("-o", "--output", default="bench_out", help="folder for JSON, Markdown and PNG results")


def run_bench(args: argparse.Namespace, progress) -> int:
    raise ValueError("the benchmark suite is not built yet (issue 6)")
