"""How `jaxdp train`'s modules depend on each other (issue 31, item 8)."""

import ast
import importlib.util
import pathlib

import jaxdp.cli

CLI = pathlib.Path(jaxdp.cli.__file__).parent


def is_module(name: str, package: str | None) -> bool:
    try:
        return importlib.util.find_spec(name, package) is not None
    except ModuleNotFoundError:  # a name inside a module: not a module
        return False


def test_the_command_lines_modules_import_no_private_names():
    """`jaxdp/cli`'s modules share plain names: a helper another module needs is that
    module's public name (the package itself is private), never a `_name` reached into
    (`_train` imported `_run`'s `_Run` and `_where`). A private module is a plain import."""
    private = []
    for path in sorted(CLI.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            package = "jaxdp.cli" if node.level else None
            module = "." * node.level + (node.module or "")
            for alias in node.names:
                name = alias.name
                if not name.startswith("_") or name == "__version__":
                    continue
                target = f"{module}.{name}" if node.module else f"{module}{name}"
                if not is_module(target, package):
                    private.append(f"{path.name}:{node.lineno}: from {module} import {name}")
    assert private == []
