"""Server configuration: one dataclass, filled from the command line or VOX_WS_* variables."""

from __future__ import annotations

from dataclasses import dataclass, field

from .protocol import Limits


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    engine: str = "auto"
    model: str | None = None
    device: str = "auto"
    threads: int = 1
    optimize: bool = False
    load_denoiser: bool = False
    max_batch: int = 8
    drain_timeout: float = 10.0
    ping_interval: float = 10.0
    ping_timeout: float = 20.0
    voices_dir: str | None = None
    lora_rank: int = 0
    lora_alpha: int | None = None
    lora_dir: str | None = None
    warm_normalizer: bool = False
    admin_tokens: list[str] = field(default_factory=list)
    # Client tokens: when any is set, every connection must present one (or an admin token).
    tokens: list[str] = field(default_factory=list)
    # Browser origins allowed to connect; empty allows any. Clients that send no Origin
    # header (servers, not browsers) are not affected.
    allow_origins: list[str] = field(default_factory=list)
    # The browser demo served at `/` (default: web/demo of the source tree when present).
    demo_dir: str | None = None
    limits: Limits = field(default_factory=Limits)

    def engine_options(self) -> dict:
        return {
            "model": self.model,
            "device": self.device,
            "threads": self.threads,
            "optimize": self.optimize,
            "load_denoiser": self.load_denoiser,
            "max_batch": self.max_batch,
            "voices_dir": self.voices_dir,
            "lora_rank": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "lora_dir": self.lora_dir,
            "warm_normalizer": self.warm_normalizer,
        }
