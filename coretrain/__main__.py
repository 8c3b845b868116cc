"""``python -m coretrain`` (and ``torchrun -m coretrain``) runs the CLI."""

import sys

from coretrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
