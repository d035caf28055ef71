"""`python -m expertflow …` is the `expertflow` command."""

import sys

from expertflow.cli import main

sys.exit(main())
