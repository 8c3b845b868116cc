"""The core's size in code lines: lines with code on them, not blank, comment or docstring lines
(a module's, class's or function's docstring, and the string right after an assignment that
documents it). The contract's documentation is the core's job; its code is what is measured.

    python benchmarks/core_size.py [--top 10]

Prints each module of ``coretrain/`` with its code lines, statements per code line and physical
lines, largest first, and the totals; ``tests/test_core_boundary.py`` holds the code lines under
a ceiling and the statements per code line under a bound. Statements are the AST's (``def``,
``if``, an assignment: each one; a docstring none): code packed to save lines — several
statements on one line, long comprehensions instead of loops — raises the ratio, code written as
a reader wants it lowers it.
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from pathlib import Path
from typing import NamedTuple

CORE = Path(__file__).resolve().parents[1] / "coretrain"
NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def docstring_lines(tree: ast.AST) -> set[int]:
    """Lines of string statements that document: first in a body, or right after an assignment."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        for body in (getattr(node, "body", None), getattr(node, "orelse", None)):
            if not isinstance(body, list):
                continue
            for i, statement in enumerate(body):
                documents = i == 0 or isinstance(body[i - 1], (ast.Assign, ast.AnnAssign))
                is_string = isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
                if documents and is_string and isinstance(statement.value.value, str):
                    lines.update(range(statement.lineno, (statement.end_lineno or statement.lineno) + 1))
    return lines


def code_lines(source: str) -> int:
    """Lines holding at least one token of code that is not part of a docstring."""
    documentation = docstring_lines(ast.parse(source))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in NOT_CODE:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in documentation)
    return len(lines)


def statements(source: str) -> int:
    """The AST's statements, docstrings (see :func:`docstring_lines`) left out."""
    tree = ast.parse(source)
    documentation = docstring_lines(tree)
    return sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, ast.stmt) and not (isinstance(node, ast.Expr) and node.lineno in documentation)
    )


class Size(NamedTuple):
    """One module's size."""

    code: int
    statements: int
    physical: int


def measure(root: Path = CORE) -> dict[str, Size]:
    """Module path -> its size, each file read once."""
    sizes = {}
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        sizes[str(path.relative_to(root.parent))] = Size(
            code_lines(source), statements(source), len(source.splitlines())
        )
    return sizes


def statements_per_line(sizes: dict[str, Size]) -> float:
    """Statements per code line over every module of ``sizes``."""
    return sum(size.statements for size in sizes.values()) / sum(size.code for size in sizes.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10, help="modules to list (0: all)")
    args = parser.parse_args(argv)
    sizes = measure()
    ranked = sorted(sizes.items(), key=lambda item: -item[1].code)
    print(f"{'code':>6} {'stmt/line':>9} {'lines':>6}")
    for name, size in ranked[: args.top or None]:
        print(f"{size.code:>6} {size.statements / max(size.code, 1):>9.3f} {size.physical:>6}  {name}")
    code_total = sum(size.code for size in sizes.values())
    physical_total = sum(size.physical for size in sizes.values())
    print(
        f"{code_total:>6} {statements_per_line(sizes):>9.3f} {physical_total:>6}  coretrain/ ({len(sizes)} modules): "
        "code lines, statements per code line, physical lines"
    )


if __name__ == "__main__":
    main()
