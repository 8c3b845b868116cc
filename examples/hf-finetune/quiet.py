"""Keep libraries' import-time lines off this example's console, as coretrain's `console-log`
plugin does for a run (where they go to run.log instead).

transformers imports torchao when it builds a model: torchao logs the kernels it cannot load
on this machine and torch warns about torchao's enums; transformers draws progress bars while
saving and loading. None of it is about the example, and a plain script has no run.log.
"""

from __future__ import annotations

import logging


def quiet_libraries() -> None:
    """Warnings of torchao and torch's pytree registry off; transformers' progress bars off."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import transformers

    transformers.utils.logging.disable_progress_bar()
