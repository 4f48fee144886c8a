"""``python -m fsdp_compile demo`` (and, as they land, ``explain`` and ``bench``)."""

from __future__ import annotations

import argparse
import sys

from . import demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(sub.add_parser("demo", help="train a small transformer on 2 CPU ranks (or GPUs)"))
    ns = parser.parse_args(argv)
    if ns.command == "demo":
        return demo.main(ns)
    raise AssertionError(ns.command)


if __name__ == "__main__":
    sys.exit(main())
