"""`python -m omnistage.cli`: the `omnistage` command."""

import sys

from omnistage.cli import main

sys.exit(main())
