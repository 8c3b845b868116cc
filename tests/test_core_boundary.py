"""The house rule: the core knows plugins only through entry points and the hook contract."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from coretrain.config import Config
from coretrain.configload import structure
from coretrain.errors import UserError
from coretrain.pluginmanager import load_plugins

PLUGIN_MODULES = {p.name for p in (REPO / "plugins").iterdir() if p.name.startswith("coretrain_")}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted((REPO / "coretrain").glob("*.py")), ids=lambda p: p.name)
def test_core_module_imports_no_plugin(path: Path) -> None:
    assert PLUGIN_MODULES, "no plugin packages found next to the core"
    assert not imported_modules(path) & PLUGIN_MODULES


def test_without_any_plugin_installed_the_core_explains_what_is_missing(tmp_path: Any) -> None:
    config = structure({"model": {"provider": "gpt"}}, Config)
    with pytest.raises(
        UserError,
        match=r"model.provider: no plugin named 'gpt' is installed; installed: none "
        r"\(install one, e.g. `pip install -e ./plugins`",
    ):
        load_plugins(config, installed={})
