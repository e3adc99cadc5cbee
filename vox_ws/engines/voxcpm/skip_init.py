"""Building the package's VoxCPM2 without the random initialisation its checkpoint then replaces.

`VoxCPM2Model.from_local` builds the whole model in float32 with every layer randomly
initialised (serially: at 2.3 B parameters most of a load), converts it to the checkpoint's
dtype, then copies the checkpoint over every parameter. Inside `built_for_checkpoint`, on the
thread that entered:

- every parameter is made on the meta device: no memory, no initialisation (`torch.nn.init`'s
  in-place functions do nothing), and the conversion before the load costs nothing. The
  AudioVAE's weight normalisation, which takes each weight's norm as it is made, gets the shapes
  it would compute instead (on the meta device it would import torch._dynamo: seconds);
- `VoxCPM2Model.load_state_dict` assigns the checkpoint's tensors in their place
  (`assign=True`, each cast to the dtype of the one it replaces, as `copy_` would): a
  safetensors file's come memory-mapped, so nothing is copied.

Buffers are made as the package makes them, so those it computes (rope tables, LoRA scales)
are the same. A parameter made inside that is still in the model after the load is one the
checkpoint did not provide: the load is refused (`NotInCheckpoint`), except for the LoRA
layers' own, which no checkpoint has and the package initialises itself
(`reset_lora_parameters`, called here as its constructor does). Other threads build modules as
usual meanwhile; one build at a time in a process.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import weakref
from typing import Any, Iterator

_one_build = threading.Lock()


class NotInCheckpoint(ValueError):
    """Parameters the checkpoint did not provide: left unmade (on the meta device)."""


@contextlib.contextmanager
def built_for_checkpoint(model_class: type) -> Iterator[None]:
    """While inside, on this thread: modules are built as the module docstring says, and
    `model_class.load_state_dict` (the package's `VoxCPM2Model`'s) assigns."""
    import torch
    from torch import nn

    with _one_build:
        owner = threading.get_ident()
        state = {"building": True}
        made = _Made()

        def ours() -> bool:
            return state["building"] and threading.get_ident() == owner

        register_parameter = nn.Module.register_parameter

        def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if param is not None and type(param) is nn.Parameter and ours():
                if not param.is_meta:
                    param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
                made.add(param)
            register_parameter(module, name, param)

        init_functions = {name: getattr(nn.init, name) for name in dir(nn.init)
                          if name.endswith("_") and not name.startswith("_")
                          and callable(getattr(nn.init, name))}

        def skipped(name: str) -> Any:
            original = init_functions[name]

            def initialise(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                return tensor if ours() else original(tensor, *args, **kwargs)
            return initialise

        # The module (`torch.nn.utils.weight_norm` is also the name of its function).
        weight_norm_module = importlib.import_module("torch.nn.utils.weight_norm")

        norm_names = ("norm_except_dim", "_weight_norm")
        norm_functions = {name: getattr(weight_norm_module, name) for name in norm_names
                          if hasattr(weight_norm_module, name)}

        def norm_except_dim(v: torch.Tensor, pow: float = 2, dim: int = 0) -> torch.Tensor:
            if not (v.is_meta and ours()):
                return norm_functions["norm_except_dim"](v, pow, dim)
            shape = [] if dim == -1 else [size if axis == dim else 1 for axis, size in enumerate(v.shape)]
            return torch.empty(shape, dtype=v.dtype, device="meta")

        def weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
            if not (v.is_meta and ours()):
                return norm_functions["_weight_norm"](v, g, dim)
            return torch.empty(v.shape, dtype=v.dtype, device="meta")

        own_load = "load_state_dict" in model_class.__dict__
        load_state_dict = model_class.load_state_dict

        def assign(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True,
                   assign: bool = False) -> Any:
            if threading.get_ident() != owner:
                return load_state_dict(model, state_dict, strict=strict, assign=assign)
            live = {**dict(model.named_parameters(remove_duplicate=False)),
                    **dict(model.named_buffers(remove_duplicate=False))}
            cast = {key: value.to(live[key].dtype) if key in live else value
                    for key, value in state_dict.items()}
            state["building"] = False
            try:
                result = load_state_dict(model, cast, strict=strict, assign=True)
                initialise_lora(model, made)
            finally:
                state["building"] = True
            # Here, before the package moves the model to its device (a meta tensor fails there,
            # obscurely) and uses it.
            check_made(model, made)
            return result

        nn.Module.register_parameter = register
        for name in init_functions:
            setattr(nn.init, name, skipped(name))
        replacements = {"norm_except_dim": norm_except_dim, "_weight_norm": weight_norm}
        for name in norm_functions:
            setattr(weight_norm_module, name, replacements[name])
        model_class.load_state_dict = assign
        try:
            yield
        finally:
            nn.Module.register_parameter = register_parameter
            for name, function in init_functions.items():
                setattr(nn.init, name, function)
            for name, function in norm_functions.items():
                setattr(weight_norm_module, name, function)
            if own_load:
                model_class.load_state_dict = load_state_dict
            else:
                del model_class.load_state_dict


class _Made:
    """The parameters made for a checkpoint to replace, by identity (a tensor's `==` compares
    values), without keeping them alive once replaced."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def add(self, param: Any) -> None:
        self._refs[id(param)] = weakref.ref(param)

    def __contains__(self, param: Any) -> bool:
        ref = self._refs.get(id(param))
        return ref is not None and ref() is param


def check_made(model: Any, made: Any) -> None:
    """Refuse `model` if a parameter in `made` (made for the checkpoint to replace) is still in
    it, or a buffer is on the meta device (computed from such a parameter)."""
    left = sorted({name for name, param in model.named_parameters(remove_duplicate=False) if param in made}
                  | {name for name, buffer in model.named_buffers(remove_duplicate=False) if buffer.is_meta})
    if left:
        raise NotInCheckpoint(f"{len(left)} model tensors missing from the checkpoint (e.g. {left[:3]})")


def initialise_lora(model: Any, made: Any) -> None:
    """The LoRA layers' own parameters the checkpoint did not provide (in `made`: none does, as a
    rule), made where the layer's weight is and initialised by the package's
    `reset_lora_parameters` as its constructor does: in float32, then in the dtype the model was
    converted to since. One the checkpoint did provide is kept."""
    import torch
    from torch import nn

    for module in model.modules():
        if not hasattr(module, "reset_lora_parameters"):
            continue
        names = [name for name in ("lora_A", "lora_B") if getattr(module, name, None) in made]
        if not names:
            continue
        dtypes, kept = {}, {}
        for name in ("lora_A", "lora_B"):
            param = getattr(module, name)
            dtypes[name] = param.dtype
            if name not in names:
                kept[name] = param
            setattr(module, name, nn.Parameter(torch.empty(param.shape, dtype=torch.float32,
                                                           device=module.weight.device),
                                               requires_grad=param.requires_grad))
        module.reset_lora_parameters()
        for name in names:
            getattr(module, name).data = getattr(module, name).data.to(dtypes[name])
        for name, param in kept.items():
            setattr(module, name, param)
