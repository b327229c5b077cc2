"""The `omnistage` command line (`parser.py`): serve (`serve.py`), plan and memory-report (`memory.py`),
make-tiny, bench; the engine's flags are derived from the settings schema (`engine_flags.py`)."""

from omnistage.cli.parser import build_parser, main
from omnistage.cli.serve import bind

__all__ = ["bind", "build_parser", "main"]
