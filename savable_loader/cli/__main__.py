"""``python -m savable_loader.cli``: the ``savable-loader`` command (the demo's child
processes are started this way)."""

from __future__ import annotations

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
