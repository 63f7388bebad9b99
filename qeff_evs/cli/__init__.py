"""The ``qeff-evs`` command: export, compile, run, encode, demo, epd-proxy (and bench)."""

from __future__ import annotations

import sys
import time

# The command's functions (commands.py) and its parser (parser.py); BACKENDS and build_parser are read here too.
from qeff_evs.cli.commands import print_progress
from qeff_evs.cli.parser import BACKENDS, build_parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        code = args.func(args)
    except ValueError as error:
        print(f"qeff-evs {args.command}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a path that is missing, unreadable or not a folder
        print(f"qeff-evs {args.command}: error: {error}", file=sys.stderr)
        return 2
    print_progress(f"{args.command} finished in {time.perf_counter() - started:.1f} s")
    return code
