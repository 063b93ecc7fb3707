"""The `pdserve` command line: one module per command, imported only when that command runs.

`main.py` holds the command table; each command module builds its own parser and its part's
typed config, once, and hands it on. Tools outside the product (`pdlab`: `bench`, `chaos`)
join the table through the `pdserve.commands` entry points.
"""

from pdserve.cli.main import main

__all__ = ["main"]
