"""vox-ws: real-time streaming text-to-speech over WebSocket, one shared batching scheduler.

The package root holds only what every part shares (the rule `tests/test_layout.py` keeps):
the wire's contract, the engine contract, the session, the server, the configuration, and the
audio, text, file and address helpers more than one layer uses. The rest lives by purpose in
its folder. Modules that once sat here keep their old names (`vox_ws.cli`, `vox_ws.client`,
`vox_ws.captions`, ...) through `_MovedModules`, with no file at the root: `import vox_ws.cli`
gives the very module `vox_ws.commands.cli` is, one object under two names."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

__version__ = "0.1.0"

# Old name -> where the module lives now. `vox_ws.cli:main` is the entry point of installs made
# before the move; `vox_ws.client` is where the Python client was first published.
MOVED = {
    "vox_ws.accelerator": "vox_ws.engines.accelerator",
    "vox_ws.captions": "vox_ws.clients.captions",
    "vox_ws.cli": "vox_ws.commands.cli",
    "vox_ws.client": "vox_ws.clients.v1",
    "vox_ws.compile_ahead": "vox_ws.commands.compile_ahead",
    "vox_ws.compile_workers": "vox_ws.engines.voxcpm.compile_workers",
    "vox_ws.cpus": "vox_ws.engines.cpus",
    "vox_ws.lexicon": "vox_ws.engines.lexicon",
    "vox_ws.logs": "vox_ws.commands.logs",
    "vox_ws.memory": "vox_ws.service.memory",
    "vox_ws.metrics": "vox_ws.service.metrics",
    "vox_ws.models": "vox_ws.commands.models",
    "vox_ws.playback": "vox_ws.clients.playback",
    "vox_ws.scheduling.devices": "vox_ws.engine_process.devices",
    "vox_ws.service.lexicon": "vox_ws.engines.lexicon",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module's old name as the module itself. Lazy: nothing is imported until
    an old name is, so a client that imports `vox_ws` loads no command line or service."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system has just set the module's `__spec__` to the old name's: it is the
        # module's own again, so `python -m`, pickling and reloads see its one real name.
        module.__spec__ = module.__spec__.loader_state


# First in line: an old name always means the module's new place, even where another finder
# (an editable install's, pointing at an older checkout) would find a file by that name.
sys.meta_path.insert(0, _MovedModules())
