"""The command line: ``python -m middleware COMMAND ...``.

Each subcommand module has ``add_parser(subparsers)`` (declares its arguments and sets
``func``) and ``main(args)``; it is listed in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import cli_profile

COMMANDS = [cli_profile.add_parser]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="middleware")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
