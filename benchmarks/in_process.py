"""An `omnistage` command run inside a measuring script's process, the script's hooks installed first
(benchmarks/sync_points.py, step_trace.py, engine_profile.py):

    parser = command_parser(__doc__)
    parser.add_argument(...)               # the script's own options, before `--`
    args = parser.parse_args()
    ...                                     # install the hooks
    failure = run(command_of(args))         # then write what they recorded
    reraise(failure)
"""

from __future__ import annotations

import argparse
import signal
import sys

from omnistage.cli import main as omnistage_main


def command_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose last argument is `-- COMMAND...`, the omnistage command to run."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the omnistage command")
    return parser


def command_of(args: argparse.Namespace) -> list[str]:
    return args.command[1:] if args.command[:1] == ["--"] else args.command


def run(command: list[str]) -> SystemExit | None:
    """Run `omnistage COMMAND` here; how it exited, if it did (the benchmark's own verdicts, such as
    --fail-on-build, still leave the script to write what it recorded)."""
    sys.argv = ["omnistage", *command]
    # a server stopped by SIGTERM: uvicorn shuts down, then raises the signal again, which ends here
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        omnistage_main()
    except SystemExit as exit:
        return exit
    return None


def reraise(failure: SystemExit | None) -> None:
    """The command's failure, once the script has written its records (a SIGTERM's 143 is no failure)."""
    if failure is not None and failure.code not in (None, 0, 143):
        raise failure
