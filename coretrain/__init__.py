"""coretrain: a small PyTorch training loop whose every feature is a plugin.

Importing this package imports no torch: plugin authors only need :data:`hookimpl`.
"""

import pluggy

__version__ = "0.2.0"

hookimpl = pluggy.HookimplMarker("coretrain")
"""Mark a plugin method as a hook implementation: ``@hookimpl`` / ``@hookimpl(trylast=True)``."""

__all__ = ["__version__", "hookimpl"]
