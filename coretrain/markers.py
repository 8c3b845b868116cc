"""pluggy's markers for the ``coretrain`` project: a leaf module, so the core's own plugins
(the API's result recorder, the testing helpers) mark hooks without importing the package root."""

from __future__ import annotations

import pluggy

PROJECT = "coretrain"
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Mark a plugin method as a hook implementation: ``@hookimpl`` / ``@hookimpl(trylast=True)``."""
hookspec = pluggy.HookspecMarker(PROJECT)
"""Mark a method of a hook specification class: the core's contract, or a plugin distribution's
own hooks for other plugins (its ``coretrain.hookspecs`` entry point names the class)."""
