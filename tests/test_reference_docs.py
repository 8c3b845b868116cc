"""The reference pages (config keys, hooks, commands) are generated from the code: a key, hook or
command without a doc, or a page that no longer says what the code does, fails here."""

from __future__ import annotations

import importlib.util
from typing import Any

from conftest import REPO


def generator() -> Any:
    spec = importlib.util.spec_from_file_location("generate_reference", REPO / "docs" / "generate_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_key_hook_and_command_has_a_doc_and_the_reference_pages_are_current() -> None:
    made, missing = generator().pages()
    assert not missing, f"no doc for {missing}"
    for name, text in made.items():
        committed = (REPO / "docs" / "reference" / name).read_text()
        assert committed == text, f"docs/reference/{name} is stale: run python docs/generate_reference.py"
    config, hooks, commands = made["config.md"], made["hooks.md"], made["commands.md"]
    assert "| `plugins.pipeline-parallel.pp_schedule` | `'1F1B' \\| 'GPipe'" in config  # the allowed values
    assert "| `distributed.step_timeout_seconds` | `plugins.watchdog.step_timeout_seconds` |" in config  # deprecated
    assert "### `on_checkpoint_saved`" in hooks and "### `pipeline_split`" in hooks  # core's and a plugin's
    assert "## `coretrain run`" in commands and "`--nproc-per-node`" in commands
