"""VoxCPM2's settings: the command-line options the engine takes, and their parsers. Imported by
the plugin's registration, so cheap: no torch."""

from __future__ import annotations

from dataclasses import dataclass

from .. import Setting, parse_bool, parse_count

# Seconds one text may take to normalise (`--normalize-timeout`'s default).
NORMALIZE_TIMEOUT_S = 3.0
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
    Setting("step-rows", parse_count, "auto",
            "rows one step carries at most (compute), below --slots's slots (memory): "
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
    Setting("cuda-graphs", parse_bool, False, "compile the whole step and replay it from CUDA graphs captured at "
                                              "start, one per bucket (per attention length too where the step "
                                              "cannot attend in place) (a CUDA "
                                              "device, no LoRA slots; off until measured: "
                                              "python -m benchmarks.device_check)"),
    Setting("warm-normalizer", parse_bool, False,
            "load the text normalizer at start-up (first use costs seconds)"),
    Setting("normalize-timeout", float, NORMALIZE_TIMEOUT_S,
            "seconds one text may take to normalize; a text that takes longer is refused (too_large)"),
)


# The engine's settings: one field per option above (by its key), and the ones every engine
# takes (device, threads, slots). `tests/test_engines.py` holds the two lists together.
COMMON = ("device", "threads", "slots")


@dataclass(frozen=True)
class VoxCPMSettings:
    """What a `VoxCPMEngine` is built with. The defaults are those of a caller that drives the
    engine itself (benchmarks, tests): eager, and where it compiles, at load (`compile_wait`);
    `vox-ws serve` fills every field from the options above, with their own defaults."""

    model: str | None = None
    device: str = "auto"
    threads: int = 1
    # KV slots (streams open at once: memory) and the rows one step carries (compute); None:
    # sized to the device at load (`VoxCPMEngine.slots`). Rows never exceed slots.
    slots: int | None = 8
    step_rows: int | None = None
    optimize: bool = False
    load_denoiser: bool = False
    voices_dir: str | None = None
    lora_rank: int = 0
    lora_alpha: int | None = None          # None: 2 x lora_rank
    lora_dir: str | None = None
    max_loras: int = 4
    compile: str = "off"
    compile_wait: bool = True
    compile_cache: str | None = None
    compile_buckets: tuple[int, ...] | None = None
    cuda_graphs: bool = False
    warm_normalizer: bool = False
    normalize_timeout: float = NORMALIZE_TIMEOUT_S

    def __post_init__(self) -> None:
        """Settings that cannot work together are refused before minutes of loading."""
        if self.optimize:
            # The package's optimize compiles its own one-request loop, which vox-ws never runs,
            # and renames the weights it wraps (`_orig_mod.*`), which the load's check then cannot match.
            raise ValueError("--optimize compiles the voxcpm package's own one-request loop, which vox-ws does not "
                             "run; use --compile auto (the default: on with CUDA) or --compile on, which compiles "
                             "vox-ws's batched step")
        if self.lora_rank > 0 and self.max_loras < 1:
            raise ValueError("--max-loras must be at least 1 with --lora-rank")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"--compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.cuda_graphs and self.lora_rank > 0:
            raise ValueError("--cuda-graphs does not take LoRA slots (--lora-rank): their row map is chosen per step")
        if self.cuda_graphs and self.compile == "off":
            raise ValueError("--cuda-graphs replays the compiled step: it needs --compile on or auto")
