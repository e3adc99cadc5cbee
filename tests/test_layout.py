"""The code's shape, read from its syntax: the import graph (lazy imports inside functions
included) has no circle, and the layers import only downward."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vox_ws"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every module of vox_ws -> the vox_ws modules it imports, wherever the import statement is."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[name] |= {alias.name for alias in node.names if alias.name in paths}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    if f"{source}.{alias.name}" in paths:      # `from . import module`
                        graph[name].add(f"{source}.{alias.name}")
                    elif source in paths:
                        graph[name].add(source)
        graph[name].discard(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_the_circle_finder_finds_a_circle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back_through_others():
    assert circles(import_graph()) == []


# The package root: what more than one layer shares, the design's named parts (the engine
# contract, the session, the server), and the entry points. Everything else lives by purpose in
# a folder (docs/ARCHITECTURE.md, "The package root"); a module moved out keeps its old name
# through `vox_ws.MOVED`, not through a file here.
ROOT_MODULES = {
    "__init__.py", "__main__.py",          # the package, `python -m vox_ws`
    "wire.py",                             # protocol v1, the contract both sides share
    "engine.py", "session.py", "server.py",  # the design's names: engine contract, session, server
    "config.py",                           # the server's settings, from the command line down
    "audio.py", "codecs.py", "text.py",    # audio and text, for the server and the clients
    "addresses.py", "files.py", "priority.py", "voice_tags.py",  # helpers of more than one layer
}


def test_the_package_root_holds_only_its_listed_modules():
    """At most 14 modules at the root, exactly those listed: a new module finds its folder."""
    root = {path.name for path in PACKAGE.glob("*.py")}
    assert root == ROOT_MODULES, f"new: {sorted(root - ROOT_MODULES)}, gone: {sorted(ROOT_MODULES - root)}"
    assert len(ROOT_MODULES) <= 14


# Each layer -> the vox_ws modules it never imports. Data flows one way: the front doors
# (transports, with the server that assembles them) -> the stream service -> the scheduler ->
# the engines; the command line sits above everything, the clients beside the server.
DOORS = ("vox_ws.transports", "vox_ws.session", "vox_ws.server")
ABOVE = {
    "vox_ws.engines": ("vox_ws.scheduling", "vox_ws.engine_process", "vox_ws.service", *DOORS, "vox_ws.commands",
                       "vox_ws.clients"),
    "vox_ws.alignment": ("vox_ws.scheduling", "vox_ws.engine_process", "vox_ws.service", *DOORS,
                         "vox_ws.commands", "vox_ws.clients"),
    "vox_ws.scheduling": ("vox_ws.engine_process", "vox_ws.service", *DOORS, "vox_ws.commands", "vox_ws.clients"),
    # The boundary: the server's stand-ins and the engine process's host, under the stream service.
    "vox_ws.engine_process": ("vox_ws.service", *DOORS, "vox_ws.commands", "vox_ws.clients"),
    "vox_ws.service": (*DOORS, "vox_ws.commands", "vox_ws.clients"),
    "vox_ws.transports": ("vox_ws.server", "vox_ws.commands", "vox_ws.clients"),
}


def _wrong_arrows(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{module} -> {target}" for module, imported in import_graph().items()
            if module == layer or module.startswith(layer + ".")
            for target in sorted(imported) if target.startswith(forbidden)]


def test_lower_layers_never_import_the_doors_or_the_service():
    """Data flows one way: engines and the scheduler know nothing of the engine process's
    boundary, the stream service, the
    front doors or the server; the service knows nothing of the doors; the doors nothing of the
    server that assembles them; none of them anything of the command line."""
    wrong = [arrow for layer, forbidden in ABOVE.items() for arrow in _wrong_arrows(layer, forbidden)]
    assert not wrong, wrong


def test_only_the_command_line_imports_the_command_line():
    wrong = [f"{module} -> {target}" for module, imported in import_graph().items()
             if not module.startswith(("vox_ws.commands", "vox_ws.__main__"))
             for target in imported if target.startswith("vox_ws.commands")]
    assert not wrong, wrong


# What a client may load besides the clients themselves: the wire's contract and the audio
# helpers (tests/test_protocol.py checks what `vox_ws.clients.v1` loads at run time).
CLIENT_SHARED = {"vox_ws", "vox_ws.wire", "vox_ws.audio", "vox_ws.codecs"}


def test_clients_import_only_the_shared_modules():
    """The clients (and the integrations, their first names) run without the server: they import
    each other and the shared modules, nothing of the server's layers."""
    wrong = [f"{module} -> {target}" for module, imported in import_graph().items()
             if module.startswith(("vox_ws.clients", "vox_ws.integrations"))
             for target in sorted(imported)
             if target not in CLIENT_SHARED and not target.startswith("vox_ws.clients")]
    assert not wrong, wrong


def test_the_session_imports_no_front_door():
    """The session is the connection's rules with no socket: the front doors drive it."""
    wrong = _wrong_arrows("vox_ws.session", ("vox_ws.transports", "vox_ws.server", "vox_ws.commands"))
    assert not wrong, wrong


def _old_names_imported() -> list[str]:
    """Imports, inside the package, of a moved module by its old name (`vox_ws.MOVED`): they
    work, through the alias, but hide the arrow from the import graph above."""
    from vox_ws import MOVED

    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            sources = []
            if isinstance(node, ast.Import):
                sources = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                sources = [source] + [f"{source}.{alias.name}" for alias in node.names]
            found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {source}"
                      for source in sources if source in MOVED]
    return found


def test_the_package_imports_no_moved_module_by_its_old_name():
    assert _old_names_imported() == []


def test_every_old_name_is_its_moved_module():
    """`import vox_ws.cli` gives the module `vox_ws.commands.cli` is: one module, two names, so
    no state (a registry, a lock) is ever made twice."""
    import importlib

    from vox_ws import MOVED

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
        assert importlib.import_module(old).__spec__.name == new


def _classes_and_functions(folder: str = ""):
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            yield path.relative_to(PACKAGE.parent), node


def _methods(cls: ast.ClassDef) -> int:
    return sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in cls.body)


def _class(module: str, name: str) -> ast.ClassDef:
    return next(node for node in ast.parse((PACKAGE / module).read_text()).body
                if isinstance(node, ast.ClassDef) and node.name == name)


def test_the_package_is_made_of_small_classes():
    """A class with more than 20 methods does more than one job; the engine contract, which
    every engine implements, keeps to 10 (its other verbs are its roles' objects); the engine
    loop drives and the queue decides, each within its own bound; a v1 connection's asyncio
    driver only moves frames and runs what the session (its rules, no socket) asks."""
    big = [f"{path}:{node.name} ({_methods(node)})" for path, node in _classes_and_functions()
           if isinstance(node, ast.ClassDef) and _methods(node) > 20]
    assert not big, big
    assert _methods(_class("engine.py", "Engine")) <= 10
    assert _methods(_class("scheduling/loop.py", "EngineLoop")) <= 18
    assert _methods(_class("scheduling/queue.py", "SlotQueue")) <= 16
    assert _methods(_class("transports/v1_connection.py", "V1Connection")) <= 12


# A compiled graph's inputs are its function's parameters, each named (the test below): these
# take the step's tensors one by one, as the graph does, and no more.
GRAPH_INPUTS = {
    "vox_ws/engines/voxcpm/compiled.py": {"velocity", "cfm_solve", "advance", "adapted_velocity",
                                          "adapted_advance", "adapted_advance_in_place", "_velocity_graph"},
}


def test_functions_take_few_parameters():
    """Six at most, anywhere in the package: a request travels as one `StreamRequest`, a client's
    as one `Speech`, an engine's settings as one object. Only a compiled graph's tensors come
    one by one (`GRAPH_INPUTS`, exactly those)."""
    many, exempt = [], set()
    for path, node in _classes_and_functions():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
            count = len(names) - (names[:1] in (["self"], ["cls"]))
            if count > 6:
                if node.name in GRAPH_INPUTS.get(str(path), ()):
                    exempt.add((str(path), node.name))
                else:
                    many.append(f"{path}:{node.name} ({count})")
    assert not many, many
    assert exempt == {(path, name) for path, names in GRAPH_INPUTS.items() for name in names}


def test_graph_inputs_are_named_not_numbered():
    """A compiled graph's batch input and dynamic sizes are named by the function's parameters,
    so a new argument cannot make them point elsewhere."""
    numbered = []
    for path, node in _classes_and_functions("engines"):
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg == "rows_of" and not isinstance(getattr(keyword.value, "value", None), str):
                    numbered.append(f"{path}:{node.lineno} rows_of")
                if keyword.arg == "dynamic" and isinstance(keyword.value, ast.Dict) and \
                        any(not isinstance(getattr(k, "value", None), str) for k in keyword.value.keys):
                    numbered.append(f"{path}:{node.lineno} dynamic")
    assert not numbered, numbered


def test_the_architecture_page_names_every_module():
    """docs/ARCHITECTURE.md names each module of the package: by its path in the package
    (`engines/voxcpm/voices.py`), or by its file name where no other module has that name."""
    import collections

    doc = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    modules = [path.relative_to(PACKAGE) for path in PACKAGE.rglob("*.py") if path.name != "__init__.py"]
    names = collections.Counter(path.name for path in modules)
    unnamed = [str(path) for path in modules
               if f"`{path}`" not in doc and f"vox_ws/{path}" not in doc
               and not (names[path.name] == 1 and f"{path.name}" in doc)]
    assert not unnamed, unnamed


def test_the_published_old_names_work_in_a_fresh_process():
    """What users' code and older installs run: the `vox-ws` script of an install made before the
    move (`from vox_ws.cli import main`), `python -m vox_ws`, and the client's helpers by their
    first names; importing `vox_ws` alone loads nothing else."""
    import subprocess
    import sys

    def run(*args: str) -> str:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True).stdout

    assert run("-c", "import sys, vox_ws; print(sorted(m for m in sys.modules if m.startswith('vox_ws')))") \
        == "['vox_ws']\n"
    old_script = "from vox_ws.cli import main; raise SystemExit(main(['--version']))"
    assert run("-c", old_script).startswith("vox-ws ")
    assert run("-m", "vox_ws", "--version").startswith("vox-ws ")
    assert run("-c", "import vox_ws.captions, vox_ws.clients.captions as c; from vox_ws.playback import "
                     "count_underruns; from vox_ws.client import connect; "
                     "print(vox_ws.captions is c)") == "True\n"
