"""``python -m coretrain``, ``torchrun -m coretrain`` and the ``coretrain`` console script run the CLI.

A Ctrl-C while Python loads the CLI (hundreds of milliseconds on a cold disk) would print a
KeyboardInterrupt traceback. Importing this module, which imports nothing of coretrain's,
installs a quiet handler first; once the CLI is loaded, Ctrl-C is a KeyboardInterrupt again,
which the CLI and the run handle themselves.
"""

import signal
import sys


def _stopped_while_loading(signum: int, frame: object) -> None:
    print("coretrain: stopped by SIGINT during start-up; nothing was trained or saved", file=sys.stderr)
    raise SystemExit(128 + signum)


signal.signal(signal.SIGINT, _stopped_while_loading)


def console() -> int:
    """The console script's entry point (``coretrain``)."""
    from coretrain.cli import main

    signal.signal(signal.SIGINT, signal.default_int_handler)
    return main()


if __name__ == "__main__":
    sys.exit(console())
