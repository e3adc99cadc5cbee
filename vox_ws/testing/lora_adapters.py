"""LoRA adapters for a checkpoint, in the voxcpm package's own format, with random weights.

The keys and shapes come from the package: it builds the model with a LoRA config of the
adapter's rank, and its `get_lora_state_dict()` names every parameter an adapter file holds.

    python -m vox_ws.testing.lora_adapters MODEL_DIR OUT_DIR NAME [NAME ...] [--rank 4] [--alpha 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def package_model(model_dir: str | Path, rank: int, alpha: float, device: str = "cpu") -> Any:
    """The package's VoxCPM with LoRA layers of this rank, as its users load it."""
    from vox_ws.engines.voxcpm.loading import import_voxcpm

    voxcpm = import_voxcpm()
    from voxcpm.model.voxcpm2 import LoRAConfig

    config = LoRAConfig(enable_lm=True, enable_dit=True, enable_proj=False, r=rank, alpha=alpha)
    return voxcpm.VoxCPM.from_pretrained(str(model_dir), load_denoiser=False, optimize=False, device=device,
                                         lora_config=config)


@dataclass(frozen=True)
class RandomAdapter:
    """A random adapter's shape: its rank and alpha, the seed of its weights and their scale, and
    whether its directory says its r and alpha (`lora_config.json`)."""

    rank: int = 4
    alpha: float = 8
    seed: int = 0
    scale: float = 0.05
    with_config: bool = False


def write_adapter(model_dir: str | Path, out: Path, adapter: RandomAdapter = RandomAdapter(),
                  model: Any = None) -> Path:
    """An adapter directory (`lora_weights.safetensors`, and `lora_config.json` with its r and
    alpha when asked) with every LoRA parameter the package's model has, random; `model`: the
    package's model with LoRA of the adapter's rank, where the caller has it loaded."""
    import torch
    from safetensors.torch import save_file

    tts = model or package_model(model_dir, adapter.rank, adapter.alpha)
    generator = torch.Generator().manual_seed(adapter.seed)
    state = {key: torch.randn(value.shape, generator=generator).to(value.dtype) * adapter.scale
             for key, value in tts.tts_model.get_lora_state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "lora_weights.safetensors"))
    if adapter.with_config:
        (out / "lora_config.json").write_text(json.dumps({"lora_config": {"r": adapter.rank, "alpha": adapter.alpha}}))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("out_dir")
    ap.add_argument("names", nargs="+")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=8)
    args = ap.parse_args(argv)
    model = package_model(args.model_dir, args.rank, args.alpha)
    for seed, name in enumerate(args.names):
        print(write_adapter(args.model_dir, Path(args.out_dir) / name, RandomAdapter(args.rank, args.alpha, seed),
                            model=model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
