"""`python -m pdlab bench|chaos ...`: the tooling's commands without the `pdserve` entry points
(a checkout on PYTHONPATH, as `make gpu-check` runs it on a machine where nothing is installed)."""

import sys

from pdlab.bench import command as bench
from pdlab.chaos import command as chaos

COMMANDS = {"bench": bench.main, "chaos": chaos.main}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: python -m pdlab {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        sys.exit(2)
    sys.exit(COMMANDS[sys.argv[1]](sys.argv[2:]))
