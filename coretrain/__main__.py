"""``python -m coretrain``, ``torchrun -m coretrain`` and the ``coretrain`` console script run the CLI.

A Ctrl-C while Python loads the CLI and parses the command line (hundreds of milliseconds on
a cold disk) would print a KeyboardInterrupt traceback — or, raised while a finalizer runs,
be swallowed, and the run would go on. Importing this module, which imports nothing of
coretrain's, installs a handler that leaves at once instead; nothing exists yet that leaving
could leave half-done. Once the command line is parsed, a command that does not handle signals
itself gets Ctrl-C as a KeyboardInterrupt again; ``run`` replaces it with its own watcher.
"""

import atexit
import os
import signal
import sys


def _stopped_while_loading(signum: int, frame: object) -> None:
    sys.stderr.write("coretrain: stopped by SIGINT during start-up; nothing was trained or saved\n")  # line-buffered
    os._exit(128 + signum)


_stopped_while_loading.coretrain_start_up = True  # type: ignore[attr-defined]  # what cli.main replaces
signal.signal(signal.SIGINT, _stopped_while_loading)


def console() -> int:
    """The console script's entry point (``coretrain``). A process whose failed run left process
    groups behind (``coretrain.dist.groups_left``) ends here after what an exit runs first (the
    ``atexit`` callbacks: logging's flush among them), without the interpreter's finalization,
    where a group's thread that ends a collective cannot take the GIL and aborts the process."""
    from coretrain.cli import main

    code = main()
    if getattr(sys.modules.get("coretrain.dist"), "groups_left", None):
        atexit._run_exitfuncs()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(console())
