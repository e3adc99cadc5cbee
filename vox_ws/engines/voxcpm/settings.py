"""VoxCPM2's settings: the command-line options the engine takes, and their parsers. Imported by
the plugin's registration, so cheap: no torch."""

from __future__ import annotations

from .. import Setting, parse_bool, parse_count

# `--compile`: never; on CUDA only; always.
COMPILE_MODES = ("off", "auto", "on")


def parse_compile(text: str) -> str:
    value = str(text).strip().lower()
    if value not in COMPILE_MODES:
        raise ValueError(", ".join(COMPILE_MODES))
    return value


def parse_buckets(text: str) -> tuple[int, ...]:
    """Batch sizes, comma-separated: 1,2,4,8."""
    sizes = tuple(sorted({int(part) for part in str(text).split(",") if part.strip()}))
    if not sizes or sizes[0] < 1:
        raise ValueError("batch sizes of at least 1, comma-separated")
    return sizes


SETTINGS = (
    Setting("model", str, None, "VoxCPM checkpoint directory or hub id (offline: from the local HF cache)"),
    Setting("optimize", parse_bool, False, "refused: the package's own torch.compile, of a loop vox-ws does not run "
                                           "(see --compile)"),
    Setting("load-denoiser", parse_bool, False,
            "load the ZipEnhancer denoiser (needs modelscope and its weights)"),
    Setting("step-rows", parse_count, "auto", "rows one step carries at most (compute), below --slots's slots (memory): "
                                      "the streams closest to running out of audio go first; default: measured "
                                      "on a CPU (with --slots auto: 4 slots a row), every slot on a GPU"),
    Setting("voices-dir", str, None, "built-in voices: NAME.wav (+ optional NAME.txt transcript) per voice"),
    Setting("lora-rank", int, 0, "LoRA adapter slots of this rank (adapters up to it load at run time, smaller ranks "
                                 "zero-padded); 0: no LoRA"),
    Setting("lora-alpha", int, None, "LoRA alpha of adapters without a lora_config.json (scaling alpha / rank; "
                                     "default: 2 x rank)"),
    Setting("lora-dir", str, None, "directory of LoRA adapters that admins may load by name"),
    Setting("max-loras", int, 4, "LoRA adapters loaded at once per device (slots; /v1/info lora.slot_bytes each)"),
    Setting("compile", parse_compile, "auto", "compile the whole step per batch bucket (torch.compile: CFM, LocEnc, "
                                              "stop head, both LMs' decode, VAE decode) in a background process "
                                              "while the server serves eager, each bucket used once compiled: "
                                              "auto = on for CUDA, and on a CPU for the buckets where it measures "
                                              "faster; on = every bucket (docs/PERFORMANCE.md)"),
    Setting("compile-wait", parse_bool, False, "compile at load instead, ready only once compiled (the start "
                                               "blocks for minutes on a first start)"),
    Setting("compile-cache", str, None, "where compiled graphs are kept between starts, so that a second start "
                                        "loads them (default: ~/.cache/vox-ws/compile)"),
    Setting("compile-buckets", parse_buckets, None, "batch sizes to compile for (default 1,2,4,...,64 up to the "
                                                    "rows a step carries; a batch runs padded up to its bucket)"),
    Setting("cuda-graphs", parse_bool, False, "replay the compiled step's CFM solve from CUDA graphs, one per bucket "
                                              "and timesteps (a CUDA device, no LoRA slots; off until measured: "
                                              "python -m benchmarks.device_check)"),
    Setting("warm-normalizer", parse_bool, False,
            "load the text normalizer at start-up (first use costs seconds)"),
    Setting("normalize-timeout", float, 3.0,
            "seconds one text may take to normalize; a text that takes longer is refused (too_large)"),
)
