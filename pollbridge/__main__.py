"""``python -m pollbridge``: the command line, the same as the ``pollbridge`` command."""

from __future__ import annotations

from bridge.cli.main import main

if __name__ == "__main__":
    main()
