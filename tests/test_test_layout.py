"""The tests' own layout: no test module imports another (a shared helper lives in conftest.py,
helpers.py or attackers.py), so a module runs alone and an xdist worker imports what it runs."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
TEST_MODULES = {path.stem for path in TESTS.glob("test_*.py")}


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function, by its first name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom):              # relative: `from .test_x import y`
            found.update(alias.name for alias in node.names)
            if node.module:
                found.add(node.module.split(".")[0])
    return found


def test_no_test_module_imports_another():
    offenders = {path.name: sorted(imported_modules(path) & (TEST_MODULES - {path.stem}))
                 for path in sorted(TESTS.glob("*.py"))}
    assert not {name: modules for name, modules in offenders.items() if modules}


def test_the_check_sees_imports_at_the_top_and_inside_functions(tmp_path):
    module = tmp_path / "test_example.py"
    module.write_text("from test_a import x\n\ndef test_b():\n    import test_c\n    from .test_d import y\n")
    assert {"test_a", "test_c", "test_d"} <= imported_modules(module)
