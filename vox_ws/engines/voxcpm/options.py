"""The generation options VoxCPM2 honours: ranges and the package's own defaults."""

from __future__ import annotations

from ...engine import OptionSpec

OPTIONS: dict[str, OptionSpec] = {
    "cfg_value": OptionSpec(float, 0.0, 10.0, 2.0, "classifier-free guidance"),
    "inference_timesteps": OptionSpec(int, 1, 100, 10, "flow-matching Euler steps"),
    "min_len": OptionSpec(int, 0, 4096, 2, "steps before the model may stop"),
    "max_len": OptionSpec(int, 1, 8192, 4096, "step cap (160 ms each); the package also caps at 6 x text tokens + 10"),
    "normalize": OptionSpec(bool, default=False, help="text normalisation (numbers, symbols) before synthesis"),
    "denoise": OptionSpec(bool, default=False, help="denoise the reference audio (needs --load-denoiser)"),
    "seed": OptionSpec(int, 0, 2**63 - 1, None,
                       "noise seed; the same seed, text, voice and options give the same audio"),
}
# Used when a request leaves an option out.
DEFAULTS = {name: spec.default for name, spec in OPTIONS.items() if spec.default is not None}
