"""The reference pages (config keys, hooks, commands) are generated from the code: a key, hook or
command without a doc, or a page that no longer says what the code does, fails here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, load_script


def generator() -> Any:
    module = load_script(REPO / "docs" / "generate_reference.py")
    return module


def test_every_key_hook_and_command_has_a_doc_and_the_reference_pages_are_current() -> None:
    made, missing = generator().pages()
    assert not missing, f"no doc for {missing}"
    for name, text in made.items():
        committed = (REPO / "docs" / name).read_text()
        assert committed == text, f"docs/{name} is stale: run python docs/generate_reference.py"
    config, hooks, commands = made["reference/config.md"], made["reference/hooks.md"], made["reference/commands.md"]
    assert "| `plugins.pipeline-parallel.pp_schedule` | `'1F1B' \\| 'GPipe'" in config  # the allowed values
    assert "| `distributed.step_timeout_seconds` | `plugins.watchdog.step_timeout_seconds` |" in config  # deprecated
    assert "### `on_checkpoint_saved`" in hooks and "### `pipeline_split`" in hooks  # core's and a plugin's
    assert "## `coretrain run`" in commands and "`--nproc-per-node`" in commands


def test_the_readme_is_a_front_page_and_every_link_of_the_docs_resolves() -> None:
    """README: what it is, set-up, the two commands, the feature map; no dated measurement (those
    are docs/benchmarks.md's). A relative link in README, CHANGELOG or docs/ names a file that
    exists, and an anchor a heading it has."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert not re.search(r"20\d\d-\d\d-\d\d|later that day", readme)
    assert "coretrain run examples/quickstart.toml" in readme and "\npytest\n" in readme
    broken = []
    for page in [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for path, anchor in re.findall(r"\]\(([^)#\s]*)(#[^)\s]*)?\)", page.read_text()):
            if path.startswith(("http://", "https://")):
                continue
            target = (page.parent / path).resolve() if path else page
            if not target.exists() or (anchor and target.suffix == ".md" and anchor[1:] not in headings(target)):
                broken.append(f"{page.relative_to(REPO)}: {path}{anchor}")
    assert not broken


def headings(page: Path) -> set[str]:
    """The anchors Markdown gives a page's headings (Python-Markdown's toc slugify: word
    characters, underscores among them, spaces and hyphens kept; runs of spaces become one hyphen)."""
    titles = re.findall(r"(?m)^#{1,6} (.+)$", page.read_text())
    return {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title.lower()).strip()) for title in titles}


def test_every_page_is_in_the_sites_navigation_and_every_shipped_plugin_in_the_plugins_guide() -> None:
    """A guide that is not in mkdocs.yml's nav is a page nobody finds; a plugin coretrain-plugins
    ships without a row in the built-in plugins' table is one nobody knows to turn on. Guides
    carry no dated measurement: those are docs/benchmarks.md's, with command, machine and date."""
    nav = set(re.findall(r":\s*(\S+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M))
    pages = {str(page.relative_to(REPO / "docs")) for page in (REPO / "docs").rglob("*.md")}
    assert pages - nav == set() and nav - pages == set()
    shipped = re.search(r"(?ms)^\[project\.entry-points\.coretrain\]\n(.*?)(?:^\[|\Z)", plugins_pyproject())
    assert shipped is not None
    names = set(re.findall(r"(?m)^([a-z0-9-]+) = ", shipped.group(1)))
    listed = set(re.findall(r"(?m)^\| `([a-z0-9-]+)` \|", (REPO / "docs" / "guides" / "plugins.md").read_text()))
    assert len(names) > 40 and names - listed == set()
    dated = [p.name for p in (REPO / "docs" / "guides").glob("*.md") if re.search(r"20\d\d-\d\d-\d\d", p.read_text())]
    assert dated == []


def plugins_pyproject() -> str:
    return (REPO / "plugins" / "pyproject.toml").read_text()


def test_every_coretrain_key_the_peers_table_names_is_a_key() -> None:
    """The table from Lightning's and the HF Trainer's names: each `section.key` and
    `[plugins.NAME] key` it gives as coretrain's is one a config accepts."""
    import attrs

    from coretrain.config import Config
    from coretrain.pluginmanager import discover

    text = (REPO / "docs" / "guides" / "config.md").read_text(encoding="utf-8")
    rows = [line for line in text.split("## Coming from Lightning")[1].splitlines() if line.startswith("| ")][2:]
    defaults = Config()
    sections = {
        f.name: {g.name for g in attrs.fields(type(getattr(defaults, f.name)))}
        for f in attrs.fields(Config)
        if attrs.has(type(getattr(defaults, f.name)))
    }
    installed = discover()
    named = 0
    for row in rows:
        ours = row.split(" | ")[-1]
        for section, key in re.findall(r"`(run|model|data|train|optimizer|checkpoint|distributed)\.(\w+)", ours):
            assert key in sections[section], row
            named += 1
        for plugin, keys in re.findall(r"`\[plugins\.([\w-]+)\]((?: \w+)?)", ours):
            fields = {f.name for f in attrs.fields(installed[plugin].load())}
            assert all(key in fields for key in keys.split()), row
            named += 1
    assert len(rows) >= 20 and named >= 25


PEERS_NOT_KEYS = {
    "configure_optimizers": "a LightningModule's method",
    "fit": "a Lightning Trainer's method",
    "accelerate": "a launcher",
    "devices": "the ranks: the launcher's --nproc-per-node",
    "compile": "a plugin's table, [plugins.compile]",
}
"""Names in the peers' columns that are no setting of the core's: no key to point at."""


def test_a_peers_name_in_the_tables_is_answered_with_the_key_it_is_here() -> None:
    """Each name of Lightning's, the HF Trainer's or nanoGPT's in docs/guides/config.md's
    "Coming from" tables, written in a config, is refused naming the core key its row gives
    (``coretrain/peer_names.toml``, or the one table that has a key of that name)."""
    from coretrain import UserError
    from coretrain.config import Config
    from coretrain.configload import structure

    text = (REPO / "docs" / "guides" / "config.md").read_text(encoding="utf-8")
    tables = text.split("## Coming from Lightning")[1]
    rows = [line for line in tables.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    checked = []
    for row in rows:
        *theirs, ours = row.strip("| ").split(" | ")
        keys = {f"{section}.{key}" for section, key in re.findall(CORE_KEY, ours)}
        if not keys:  # a plugin's table, or a header
            continue
        spans = re.findall(r"`([^`]+)`", " ".join(theirs))
        names = {re.match(r"\w*", span).group() for span in spans} | set(re.findall(r"(\w+)=", " ".join(spans)))
        for name in sorted(n for n in names if re.fullmatch(r"[a-z][a-z0-9_]*", n) and n not in PEERS_NOT_KEYS):
            with pytest.raises(UserError) as raised:
                structure({"tokenizer": {name: 1}}, Config)  # [tokenizer] has no key of such a name
            said = re.search(rf"tokenizer\.{name}: unknown key \(here it is ([\w.]+)\)", str(raised.value))
            assert said and said.group(1) in keys, (name, row, str(raised.value))
            checked.append(name)
    assert len(checked) >= 40, checked


CORE_KEY = r"`(run|model|data|train|optimizer|checkpoint|distributed)\.(\w+)"
