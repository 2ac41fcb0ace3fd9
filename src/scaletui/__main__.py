"""`python -m scaletui ...` is the `scaletui` command."""

import sys

from scaletui.cli import main

sys.exit(main())
