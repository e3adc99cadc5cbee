"""VoxCPM2 behind the shared engine loop: loading, request checks, prefill, the batched step.

Loading goes through the package's own `VoxCPM.from_pretrained` (`loading.py`); generation goes
through `runner.BatchedVoxCPM2`, which advances every active stream in one batched step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ...engine import Engine, ErrorKind, GenerationRequest, Refused, StepResult
from ..accelerator import DEVICE_LOCK
from .adapters import AdapterBook
from .background import BackgroundCompile
from .cache_trust import trusted_cache_dir
from .compile_workers import compile_workers, use_compile_workers
from .compiled import BUCKETS, CompiledStep, buckets_for, default_cache_dir, use_cache_dir, warm_compiler
from .decoder_process import DecoderProcess
from .graphs import PrecompileUnavailable
from .kv import attention_kernel
from .loading import DEFAULT_MODEL, architecture, from_pretrained, import_voxcpm, resolve_model_path, verify_weights
from .normalizer import Normalizer
from .options import DEFAULTS, OPTIONS
from .prompt import build_prompt, prompt_positions
from .runner import BatchedVoxCPM2, PrefillInput, wants_decode_process
from .settings import VoxCPMSettings
from .text_rules import VoxCPMText
from .voices import VoxCPMVoices, builtin_voice_files

log = logging.getLogger("vox_ws.engines.voxcpm")


# `--slots auto`: never more slots than this (a GPU's step time grows with them too); on a
# CPU at most this many rows are tried.
AUTO_MAX_SLOTS = 64
AUTO_MAX_SLOTS_CPU = 32
# `--slots auto` on a CPU: the KV slots, as many times the rows one step carries (sized by
# measuring): a stream well ahead of its listener holds a slot without a row, so more streams
# are open than one step carries, and the steps go to those about to run out.
CPU_SLOTS_PER_ROW = 4


# The languages VoxCPM2's model card lists (it reads the language from the text: no tag is
# given to the model), and nine Chinese dialects besides.
LANGUAGES = ("ar", "da", "de", "el", "en", "es", "fi", "fr", "he", "hi", "id", "it", "ja", "km", "ko", "lo", "ms",
             "my", "nl", "no", "pl", "pt", "ru", "sv", "sw", "th", "tl", "tr", "vi", "zh")


class VoxCPMEngine(Engine):
    name = "voxcpm"
    options = OPTIONS
    supports_voices = True
    cuts_texts = True
    languages = LANGUAGES

    def __init__(self, settings: VoxCPMSettings | None = None, **fields: Any) -> None:
        """Built from `settings` (`settings.py`), or from its fields by name
        (`VoxCPMEngine(model=..., slots=4)`); raises ValueError for settings that cannot work together."""
        self.settings = dataclasses.replace(settings or VoxCPMSettings(), **fields)
        self.model = self.settings.model or DEFAULT_MODEL
        self.device = self.settings.device or "auto"
        slots, step_rows = self.settings.slots, self.settings.step_rows
        self._slots = slots
        if slots is not None:
            self.max_step_batch = min(step_rows or slots, slots)
        else:
            self.max_step_batch = step_rows or 1     # until `load` sizes both
        self._slots_reason = "--slots" + (" and --step-rows" if step_rows is not None else "")
        self._voices_dir = Path(self.settings.voices_dir) if self.settings.voices_dir else None
        lora_rank = self.settings.lora_rank
        self._lora_alpha = self.settings.lora_alpha if self.settings.lora_alpha is not None else 2 * lora_rank
        self._compile_buckets = tuple(self.settings.compile_buckets) if self.settings.compile_buckets else BUCKETS
        self._compile_cache = self.settings.compile_cache    # made the checked private one at load
        self.compiled = None       # compiled.CompiledStep, when the step is compiled
        self.precompile: bool | None = None   # False where no compiled step could be made for want of it
        self.background = None     # background.BackgroundCompile, while and after it compiles
        self.loras = AdapterBook(None, {}, self.settings.lora_dir, 0.0)    # until `load` builds the slots
        self.tts = None            # voxcpm.VoxCPM
        self.runner = None         # runner.BatchedVoxCPM2
        self.voices = VoxCPMVoices(self)
        self._normalizer = Normalizer(self.settings.normalize_timeout)
        self.text = VoxCPMText(self, self._normalizer)
        self.dtype = ""
        self.architecture = ""
        self.attention = ""        # the SDPA kernel the decode attention runs on (`kv.attention_kernel`)

    @property
    def honoured_options(self) -> frozenset[str]:
        # `denoise` is checked (it needs `--load-denoiser`) but changes nothing in generation:
        # the package applies it to prompt files, and voices here are encoded from samples.
        return frozenset(OPTIONS) - {"denoise"}

    # ------------------------------------------------------------------ loading

    def load(self) -> None:
        import torch

        if self.settings.threads:
            torch.set_num_threads(self.settings.threads)
        os.environ.setdefault("TQDM_DISABLE", "1")
        path = resolve_model_path(self.model)
        expected = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if self._compiles(expected):
            # Inductor's files are code this process loads: its cache (its probe of the CPU's
            # vector instructions included) is the checked private one before anything imports
            # or warms the compiler, here and in every child started after, which inherit it.
            self._compile_cache = str(use_cache_dir(trusted_cache_dir(
                Path(self._compile_cache) if self._compile_cache else default_cache_dir())))
        import_voxcpm()
        lora_config = None
        if self.settings.lora_rank > 0:
            from voxcpm.model.voxcpm2 import LoRAConfig

            lora_config = LoRAConfig(enable_lm=True, enable_dit=True, enable_proj=False, r=self.settings.lora_rank,
                                     alpha=self._lora_alpha)
        if self.settings.load_denoiser:
            _check_denoiser_dependencies()
        # Where the step will be compiled here, the compiler warms up while the weights load.
        compiler = None
        will_compile = self._compiles(expected) and self.settings.compile_wait
        # Inductor's compile workers, here and in the decoder process: one per CPU of this
        # container where this process compiles; else none (it only loads graphs, and a pool, which
        # loading a Triton kernel starts, would sit idle).
        use_compile_workers(compile_workers() if will_compile else 1)
        if will_compile:
            compiler = threading.Thread(target=warm_compiler, args=(expected.split(":")[0],),
                                        name="vox-ws-warm-compiler", daemon=True)
            compiler.start()
        self.architecture = architecture(path)
        if self.architecture != "voxcpm2":
            raise ValueError(f"{path} is a {self.architecture!r} checkpoint; the batched engine serves VoxCPM2 only")
        # The decoder process imports torch and voxcpm (and warms its compiler) while the model loads.
        decoder = (DecoderProcess(threads=torch.get_num_threads(), warm_compiler=will_compile)
                   if wants_decode_process(expected.split(":")[0]) else None)
        try:
            # Never beside another engine's CUDA graph capture (`cuda_graphs.py`).
            with DEVICE_LOCK:
                self.tts = from_pretrained(
                    path, load_denoiser=self.settings.load_denoiser, optimize=False,
                    device=None if self.device == "auto" else self.device, lora_config=lora_config,
                )
                model = self.tts.tts_model
                verify_weights(model, path)
            if lora_config is not None:
                self.loras = self._adapter_slots(model)
            self.device = str(model.device)
            if self.settings.cuda_graphs and not self.device.startswith("cuda"):
                raise ValueError(f"--cuda-graphs needs a CUDA device; the model is on {self.device}")
            self.dtype = str(model.config.dtype)
            self.attention = attention_kernel(model.base_lm, model.device, model._dtype())
            log.info("decode attention: SDPA's %s kernel (%s, %s)", self.attention, self.device, self.dtype)
            self.sample_rate = int(model.sample_rate)
            self.voice_sample_rate = int(model._encode_sample_rate)
            if self._slots is None:
                self.runner = self._size_slots(model, decoder)
            else:
                self.runner = self._runner(model, self._slots, self.max_step_batch, decoder)
        except BaseException:
            if decoder is not None and not decoder.has_vae:     # no runner has it
                decoder.close()
            raise
        self.text.loaded(model.text_tokenizer, self.runner.max_len, self.tts.denoiser is not None, str(path))
        if self.settings.warm_normalizer:
            self._normalizer.ensure_started()
        if self._voices_dir is not None:
            for name, audio, rate, transcript in builtin_voice_files(self._voices_dir):
                mode = "both" if transcript else "reference"
                self.voices.register(audio, rate, transcript, mode, name=name)
                log.info("built-in voice %r from %s (%s)", name, self._voices_dir, mode)
        if compiler is not None:
            compiler.join()
        if self._compiles(self.device):
            # CUDA graphs are captured at start, never while steps are served (`cuda_graphs.py`).
            if self.settings.compile_wait or self.settings.cuda_graphs:
                self._compile_step(model)
            else:
                self._compile_in_background(path)
        # One short generation warms every code path before the first user arrives.
        row = self.runner.prefill(PrefillInput(build_prompt(model, "Hello.", None), seed=0, cfg_value=2.0,
                                               timesteps=2, min_len=0, max_len=1))
        try:
            self.runner.step([row])
        finally:
            self.runner.release(row)
        self.runner.wait_ready()

    def _compiles(self, device: str) -> bool:
        """Whether the step is compiled on `device` (`--compile`): `auto` on a CPU only in the
        background, where each bucket is measured before it is used."""
        if self.settings.compile == "auto" and not device.startswith("cuda"):
            return not self.settings.compile_wait
        return self.settings.compile in ("on", "auto")

    def _compile_in_background(self, path: Path) -> None:
        """Start compiling every bucket in a child process; `_adopt_compiled` takes each in."""
        buckets = buckets_for(self.max_step_batch, self._compile_buckets)
        # Whose graphs the server will load: the cache made private here first (`cache_trust`).
        try:
            compiled = CompiledStep(self.tts.tts_model, buckets, self._compile_cache, adapters=self.loras.adapters,
                                    load_only=True, cuda_graphs=self.settings.cuda_graphs)
        except PrecompileUnavailable as exc:
            # Graphs a child compiled could not be loaded here: this process would compile them
            # itself, on the engine's thread, for minutes. Serving stays eager.
            self.precompile = False
            log.warning("the step is not compiled in the background: %s; serving eager (--compile-wait compiles "
                        "at start instead, in this process)", exc)
            return
        self.compiled = compiled
        # Loaded, run once and compared with eager off the engine loop's thread (the reader's);
        # it switches in what agreed between two steps (`runner.adopt`).
        runner = self.runner
        self.background = BackgroundCompile({
            "model": str(path), "device": self.device, "threads": self.settings.threads, "buckets": list(buckets),
            "cache": str(self.compiled.cache_dir), "lora_rank": self.settings.lora_rank, "lora_alpha": self._lora_alpha,
            "max_loras": self.settings.max_loras,
            # How the graphs attend, as chosen here (probed on a GPU): the child compiles them so.
            "in_place": compiled.in_place,
            # Where compiling is not certain to pay (a CPU, `auto`), each bucket is timed both ways.
            "measure": self.settings.compile == "auto" and not self.device.startswith("cuda")},
            lambda rows: compiled.prepare((rows,), runner.eager, runner.serving_state()),
            lambda: compiled.prepare_decode(runner.vae))

    def _adopt_compiled(self) -> None:
        """Between two steps (the engine loop's thread): the buckets the background compile has put
        in the cache since the last step go into use, each where it is the faster (`auto` on a
        CPU) or always; the decode once every bucket is there."""
        background, compiled = self.background, self.compiled
        for event in background.arrived():
            try:
                if event["event"] == "bucket":
                    measured = background.slower_than_eager(event["rows"])
                    if measured is not None:
                        background.declined.append(event["rows"])
                        log.info("the compiled step for %d rows is not faster here (%.1f ms against %.1f eager): "
                                 "left eager", event["rows"], measured["compiled_ms"], measured["eager_ms"])
                        continue
                    self.runner.adopt(compiled, (event["rows"],))
                    background.adopted.append(event["rows"])
                elif event["event"] == "decode" and background.adopted:
                    self.runner.adopt(compiled, decode=True)
                    background.adopted_decode = True
            except Exception as exc:  # noqa: BLE001 - a graph that cannot be used leaves the step eager
                log.warning("compiled graphs for %s not used (%s: %s): eager instead", event, type(exc).__name__, exc)

    def _compile_step(self, model: Any) -> None:
        """Compile the step for every bucket up to the rows a step carries, now: `/readyz` says
        `compiling` meanwhile; the compile cache makes a second start fast."""
        buckets = buckets_for(self.max_step_batch, self._compile_buckets)
        compiled = CompiledStep(model, buckets, self._compile_cache, adapters=self.loras.adapters,
                                cuda_graphs=self.settings.cuda_graphs)
        self.loading_phase = "compiling"
        started = time.perf_counter()
        try:
            self.runner.compile(compiled)
        finally:
            self.loading_phase = None
        self.compiled = compiled
        log.info("the step is compiled for %s rows in %.1f s (cache %s)", list(buckets),
                 time.perf_counter() - started, self.compiled.cache_dir)

    def _adapter_slots(self, model: Any) -> AdapterBook:
        """Every LoRA layer the package built becomes one with `--max-loras` slots."""
        from .lora import install_row_lora

        package_keys = frozenset(k for k, _ in model.named_parameters() if "lora_" not in k)
        adapters, layers = install_row_lora(model, self.settings.max_loras, self.settings.lora_rank)
        book = AdapterBook(adapters, layers, self.settings.lora_dir, self._lora_alpha, package_keys)
        log.info("LoRA: %d adapter slots of rank %d over %d layers, %.1f MiB a slot", self.settings.max_loras,
                 self.settings.lora_rank, len(layers), book.slot_bytes() / 2**20)
        return book

    def slots(self) -> tuple[int, str]:
        return self._slots, self._slots_reason

    def _size_slots(self, model: Any, decoder: DecoderProcess | None) -> Any:
        """`--slots auto`: on a GPU, as many slots as the KV caches of 80% of the free memory
        hold (each slot has room for the model's whole context); on a CPU, the most rows whose
        batched step takes at most half the audio it makes (every stream stays ahead of real
        time with room to spare), measured here. Returns the runner to serve with, which decodes
        in `decoder`, if any."""
        import torch

        from .kv import slot_bytes

        dtype = next(model.base_lm.parameters()).dtype
        per_slot = sum(slot_bytes(lm, model.config.max_length, dtype) for lm in (model.base_lm, model.residual_lm))
        if self.device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info(torch.device(self.device))
            # The background compile loads the weights again on this device, with a few slots and
            # its compiler's work space: left free for it (twice the weights).
            weights = sum(t.numel() * t.element_size() for t in model.parameters())
            spared = 2 * weights if self._compiles(self.device) and not self.settings.compile_wait else 0
            # KV is most of a slot; activations and the streaming VAE's state take a quarter more.
            # Two slots of it are the runner's own: the padding rows' and the comparisons'.
            slots = max(1, min(AUTO_MAX_SLOTS, int(max(free - spared, 0) * 0.8 // (per_slot * 1.25)) - 2))
            self._slots = slots
            self.max_step_batch = min(self.settings.step_rows or slots, slots)
            self._slots_reason = (f"{free / 2**30:.1f} GiB free on {self.device} after loading"
                                  + (f", {spared / 2**30:.1f} GiB of it left to the background compile"
                                     if spared else "")
                                  + f", {per_slot / 2**20:.0f} MiB of KV per slot (whole context) + 25%: 80% of the "
                                  f"rest holds {slots} and the runner's padding and check slots"
                                  + (f" (capped at {AUTO_MAX_SLOTS})" if slots == AUTO_MAX_SLOTS else "")
                                  + f"; {self.max_step_batch} rows a step")
            return self._runner(model, slots, self.max_step_batch, decoder)
        # Rows tried: at most what half of the free memory holds.
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        trial = max(1, min(AUTO_MAX_SLOTS_CPU, int(available * 0.5 // per_slot)))
        runner = BatchedVoxCPM2(model, trial, adapters=self.loras.adapters, decoder=decoder)
        runner.wait_ready()                  # the decoder process has warmed up: time steps, not that
        step_audio_s = runner.samples_per_step / model.sample_rate
        chosen, timings = 1, {}
        size = 1
        while size <= trial:
            rows = [runner.prefill(PrefillInput(build_prompt(model, "Sizing the slots.", None), seed=n, cfg_value=2.0,
                                                timesteps=10, min_len=0, max_len=8)) for n in range(size)]
            try:
                runner.step(rows)                                  # warm this batch size
                started = time.perf_counter()
                for _ in range(3):
                    runner.step(rows)
                took = (time.perf_counter() - started) / 3
            finally:
                for row in rows:
                    runner.release(row)
            timings[size] = round(took * 1000, 1)
            if took > step_audio_s / 2:
                break
            chosen = size
            size *= 2
        rows = min(self.settings.step_rows or chosen, trial)
        slots = min(trial, CPU_SLOTS_PER_ROW * rows)
        self._slots, self.max_step_batch = slots, rows
        self._slots_reason = (f"on {self.device} a step of B rows took {timings} ms for {step_audio_s * 1000:.0f} ms "
                              f"of audio each: the most rows within half of that is {chosen}; "
                              + (f"{rows} rows a step (--step-rows), " if self.settings.step_rows else "")
                              + f"{slots} slots ({CPU_SLOTS_PER_ROW} per row"
                              + (f", at most {trial} in half the free memory)" if slots == trial else ")"))
        if slots < trial:                    # the caches of slots never used are given back
            decoder = runner.take_decoder()
            runner.close()
            runner = self._runner(model, slots, rows, decoder)
        return runner

    def _runner(self, model: Any, slots: int, warm_rows: int, decoder: DecoderProcess | None) -> Any:
        return BatchedVoxCPM2(model, slots, warm_rows=warm_rows, adapters=self.loras.adapters, decoder=decoder)

    def close(self, deadline: float | None = None) -> None:
        # Each helper process takes its time from what is left until `deadline`.
        if self.background is not None:
            self.background.close(deadline)
        self._normalizer.close(deadline)
        if self.runner is not None:
            self.runner.close(deadline)

    def describe(self) -> dict[str, Any]:
        compiled = self.compiled
        return {**super().describe(), "dtype": self.dtype, "attention": self.attention, "lora": self.loras.describe(),
                "slots": self._slots, "step_rows": self.max_step_batch,
                "compile": {"mode": self.settings.compile, "compiled": bool(compiled and compiled.ready),
                            "precompile": self.precompile if compiled is None else compiled.store.precompile,
                            "cuda_graphs": (self.runner.captured.describe()
                                            if self.runner is not None and self.runner.captured else None),
                            "mismatched": ({str(k): v for k, v in compiled.mismatched.items()} if compiled
                                           else {}),
                            # In place or gathered, and why it gathers where it does.
                            "attention": compiled.attention.describe() if compiled else None,
                            "buckets": sorted(compiled.ready) if compiled else [],
                            "compile_s": dict(compiled.compile_s) if compiled else {},
                            "graphs": ({"loaded": compiled.store.loaded, "compiled": compiled.store.compiled}
                                       if compiled else {"loaded": 0, "compiled": 0}),
                            **({"background": self.background.describe()} if self.background else {})},
                "memory": peak_memory(self.device, self.runner is not None)}

    # ------------------------------------------------------------------ requests

    def _voice_cache(self, request: GenerationRequest) -> dict | None:
        if request.voice_pin is not None:
            return request.voice_pin
        cache = self.voices.book.get(request.voice)
        if request.voice is not None and cache is None:
            raise Refused(ErrorKind.INVALID, f"unknown voice {request.voice!r}: it was deleted", field="voice")
        return cache

    def check(self, request: GenerationRequest) -> None:
        self.text.check(request, self._voice_cache(request))

    def prefill(self, request: GenerationRequest) -> None:
        (error,) = self.prefill_many([request])
        if error is not None:
            raise error

    def prefill_many(self, requests: list[GenerationRequest]) -> list[BaseException | None]:
        """Each request's prompt built and checked on its own; then every prompt that passed goes
        into the model in batched calls (`BatchedVoxCPM2.prefill_many`)."""
        errors: list[BaseException | None] = [None] * len(requests)
        ready: list[tuple[int, PrefillInput, str]] = []
        for index, request in enumerate(requests):
            try:
                given, text = self._prefill_input(request)
            except Exception as exc:  # noqa: BLE001 - this request's refusal, typed or not
                errors[index] = exc
                continue
            ready.append((index, given, text))
        try:
            rows = self.runner.prefill_many([given for _, given, _ in ready]) if ready else []
        except Exception as exc:  # noqa: BLE001 - not one prompt's fault: each fails with it
            rows = [exc] * len(ready)
        for (index, _, text), row in zip(ready, rows):
            request = requests[index]
            if isinstance(row, BaseException):
                self.loras.row_ended(request.lora_pin)
                errors[index] = row
                continue
            request.state = row
            if request.keep_continuation:
                row.patches = []
                row.text = text
        return errors

    def _prefill_input(self, request: GenerationRequest) -> tuple[PrefillInput, str]:
        """The prompt and settings of one request's prefill, checked to fit its KV slot, with its
        adapter taken (`row_started`); and the text it speaks."""
        options = {**DEFAULTS, **request.options}
        model = self.tts.tts_model
        cache = self._voice_cache(request)
        text = self.text.spoken(request, cache)
        if options.get("normalize") and not request.prepared:
            # Only for callers that drive the engine without the stream service.
            text = self._normalizer.normalize(text)
        if request.context is not None:
            # Continue from the previous segment of the same stream: its text and generated audio
            # become the prompt (after the voice's own), so prosody carries over.
            merged = model.merge_prompt_cache(cache, request.context["text"], request.context["audio_feat"])
            if self.runner.fits(*prompt_positions(model, text, merged), options["max_len"]):
                cache = merged
        if not self.runner.fits(*prompt_positions(model, text, cache), options["max_len"]):
            raise Refused(ErrorKind.TOO_LARGE, "text too long for the model's context after normalization")
        prompt = build_prompt(model, text, cache)
        adapter = self.loras.row_started(request.lora_pin)
        return PrefillInput(prompt, seed=options["seed"], cfg_value=options["cfg_value"],
                            timesteps=options["inference_timesteps"], min_len=options["min_len"],
                            max_len=options["max_len"], adapter=adapter), text

    def step(self, batch: list[GenerationRequest]) -> list[StepResult]:
        if self.background is not None:
            self._adopt_compiled()
        results = self.runner.step([r.state for r in batch])
        return [StepResult(audio=audio, finished=reason) for audio, reason in results]

    def release(self, request: GenerationRequest) -> None:
        row = request.state
        if row is not None:
            self.runner.release(row)
            self.loras.row_ended(request.lora_pin)
            if row.patches:
                import numpy as np
                import torch

                request.continuation = {"text": row.text, "audio_feat": torch.from_numpy(np.stack(row.patches))}
        request.state = None


def _check_denoiser_dependencies() -> None:
    try:
        import modelscope  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "--load-denoiser needs the `modelscope` package and the ZipEnhancer weights "
            "(iic/speech_zipenhancer_ans_multiloss_16k_base) in the local ModelScope cache; "
            "neither is installed by vox-ws"
        ) from None


def peak_memory(device: str, loaded: bool) -> dict[str, float]:
    """The peaks of the process the engine runs in (its engine process under `vox-ws serve`,
    which the server's own figures cannot see): resident memory, and on a GPU, once `loaded`,
    what PyTorch's allocator held there."""
    import resource

    figures = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if device.startswith("cuda") and loaded:
        import torch

        figures["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(torch.device(device)) / 2**20, 1)
    return figures
