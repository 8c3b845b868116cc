"""One module per ``coretrain`` command: each adds its parser (``add``) and holds its handler.

Only argparse and the standard library are imported at module level, so ``coretrain --help``
starts fast and never imports torch; a handler imports what it needs.
"""
