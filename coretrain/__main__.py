"""``python -m coretrain`` (and ``torchrun -m coretrain``) runs the CLI."""

import signal
import sys


def _stopped_while_loading(signum: int, frame: object) -> None:
    print("coretrain: stopped by SIGINT during start-up; nothing was trained or saved", file=sys.stderr)
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    # a Ctrl-C while Python loads the CLI ends it quietly; the run installs its own handler
    signal.signal(signal.SIGINT, _stopped_while_loading)
    from coretrain.cli import main

    sys.exit(main())
