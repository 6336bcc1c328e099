"""Fingerprints of Python definitions, to hold the verbatim peer copies to their source.

A fingerprint is a hash of a definition's syntax tree without docstrings and decorators, so it
ignores formatting (ruff reformats the copies) and sees any change to the code.
"""

from __future__ import annotations

import ast
import copy
import hashlib
from importlib import metadata


def _strip(node: ast.AST) -> ast.AST:
    node = copy.deepcopy(node)
    for sub in ast.walk(node):
        if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            sub.decorator_list = []
            body = sub.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                sub.body = body[1:] or [ast.Pass()]
    return node


def fingerprint(nodes: ast.AST | list[ast.stmt]) -> str:
    """sha256 (16 hex digits) of the definition(s) without docstrings and decorators."""
    nodes = nodes if isinstance(nodes, list) else [nodes]
    text = "\n".join(ast.dump(_strip(node), include_attributes=False) for node in nodes)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def definitions(source: str) -> dict[str, ast.AST]:
    """Top-level functions and classes of a module by name, and methods as 'Class.method'."""
    found: dict[str, ast.AST] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            found[node.name] = node
        if isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef):
                    found[f"{node.name}.{sub.name}"] = sub
    return found


def statements_between(function: ast.AST, first: str, last: str) -> list[ast.stmt]:
    """The run of statements, in the block that holds them, from the one whose source starts
    with `first` to the one whose source starts with `last` (inline code inside a method, or in
    a module when `function` is the parsed module)."""
    for block in ast.walk(function):
        for field in ("body", "orelse"):
            statements = getattr(block, field, None)
            if not isinstance(statements, list):
                continue
            texts = [ast.unparse(s) for s in statements]
            starts = [i for i, t in enumerate(texts) if t.startswith(first)]
            ends = [i for i, t in enumerate(texts) if t.startswith(last)]
            if starts and ends and ends[-1] >= starts[0]:
                return statements[starts[0] : ends[-1] + 1]
    name = getattr(function, "name", "the module")
    raise LookupError(f"no block from {first!r} to {last!r} in {name}")


def block_statements(function: ast.FunctionDef) -> list[ast.stmt]:
    """A copied block: the body of the function that holds it, without its docstring and its
    return statement."""
    return function.body[1:-1]


def source_block(source: str, method: str, first: str, last: str) -> list[ast.stmt]:
    """The block of a peer's source: in ``method`` ('Class.method', or '' for module level)."""
    node = definitions(source)[method] if method else ast.parse(source)
    return statements_between(node, first, last)


def installed_source(distribution: str, version: str, path: str) -> str | None:
    """The text of `path` inside an installed distribution of exactly `version` (read from disk,
    never imported), or None when that version is not installed."""
    try:
        if metadata.version(distribution) != version:
            return None
        return metadata.distribution(distribution).locate_file(path).read_text()
    except (metadata.PackageNotFoundError, FileNotFoundError):
        return None
