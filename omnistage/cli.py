"""The `omnistage` command line: serve, make-tiny."""

from __future__ import annotations

import argparse
import logging
import sys

from omnistage.errors import OmnistageError


def _make_tiny(args: argparse.Namespace) -> None:
    from omnistage.models.qwen3_omni.tiny import make_tiny

    path = make_tiny(args.directory, seed=args.seed)
    print(f"wrote a tiny random Qwen3-Omni checkpoint to {path}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny", help="write a tiny random-weight Qwen3-Omni checkpoint in the released layout")
    tiny.add_argument("directory", help="output directory (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="random seed; the same seed writes the same files")
    tiny.set_defaults(func=_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except OmnistageError as exc:
        print(f"omnistage: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
