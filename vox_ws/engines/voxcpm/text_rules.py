"""How VoxCPM2 takes text (`Engine.text`): normalised on request (Chinese and English), cut at
sentence ends into pieces whose prompt fits a KV slot, "(description)text" for instructions.

Portable: no torch here. The engine holds these rules with the package's tokenizer and its prompt
caches; the server process makes its own copy (`from_settings`) with the same tokenizer loaded
from the checkpoint (`tokens.TextTokens`) and the voices' summaries (`VoxCPMVoices.summary`), so
texts are cut and checked where the model is not, with no round trip to it.
"""

from __future__ import annotations

import secrets
from typing import Any, Callable

from ...engine import ErrorKind, GenerationRequest, Refused, TextRules
from ...text import base_language, pack
from .normalizer import Normalizer
from .options import DEFAULTS
from .positions import clean_text, fits, prompt_positions

# The languages the package's text normaliser has grammars for ("en" also stands for a text
# whose language is not said: the normaliser then tells Chinese from English itself).
NORMALIZED_LANGUAGES = ("zh", "en")


class VoxCPMText(TextRules):
    def __init__(self, engine: Any, normalizer: Normalizer) -> None:
        super().__init__(engine)
        self.normalizer = normalizer
        # Set once the model has loaded (`loaded`): until then every text is one piece.
        self.tokenizer: Callable[[str], list[int]] | None = None
        self.slot_positions = 0
        self.denoiser = False
        self.checkpoint = ""

    def loaded(self, tokenizer: Callable[[str], list[int]], slot_positions: int, denoiser: bool,
               checkpoint: str) -> None:
        """The model's tokenizer, its KV slots' positions, whether it denoises prompts, and the
        checkpoint the server's copy loads the same tokenizer from."""
        self.tokenizer, self.slot_positions, self.denoiser, self.checkpoint = \
            tokenizer, slot_positions, denoiser, checkpoint

    @classmethod
    def from_settings(cls, engine: Any, settings: dict[str, Any]) -> VoxCPMText:
        from .tokens import TextTokens

        rules = cls(engine, Normalizer(settings["normalize_timeout"]))
        rules.loaded(TextTokens(settings["checkpoint"]), settings["slot_positions"], settings["denoiser"],
                     settings["checkpoint"])
        return rules

    def portable(self) -> tuple[str, dict[str, Any]] | None:
        if self.tokenizer is None:
            return None
        return f"{__name__}:VoxCPMText", {"checkpoint": self.checkpoint, "slot_positions": self.slot_positions,
                                          "denoiser": self.denoiser, "normalize_timeout": self.normalizer.timeout_s}

    def close(self, deadline: float | None = None) -> None:
        """Stop the normaliser's process (the server's copy's; the engine closes its own)."""
        self.normalizer.close(deadline)

    def needs_preparing(self, options: dict[str, Any], language: str | None = None) -> bool:
        # Text in a language the normaliser has no grammar for is spoken as written (its
        # numbers would be read out in English).
        return bool(options.get("normalize")) and base_language(language) in NORMALIZED_LANGUAGES

    def prepare(self, text: str, options: dict[str, Any], language: str | None = None) -> str:
        return self.normalizer.normalize(clean_text(text))

    def fits(self, text: str, pin: Any, max_len: int, growth: int = 1) -> bool:
        """Whether `text` (with the voice `pin`) and its longest generation fit a KV slot, its
        tokens allowed to grow `growth` times (normalisation yet to come)."""
        positions, tokens = prompt_positions(self.tokenizer, text, pin)
        return fits(positions + (growth - 1) * tokens, growth * tokens, max_len, self.slot_positions)

    def split(self, text: str, options: dict[str, Any], voice_pin: Any = None,
              language: str | None = None) -> list[str]:
        if self.tokenizer is None:
            return [text]
        max_len = options.get("max_len", DEFAULTS["max_len"])
        # Normalisation comes later and may lengthen a piece (digits spelled out): leave room.
        growth = 2 if options.get("normalize") else 1
        return pack(text, lambda piece: self.fits(clean_text(piece), voice_pin, max_len, growth), language)

    def check(self, request: GenerationRequest, pin: Any) -> None:
        """A text with nothing to say, or one too long for a slot with its voice, is refused; a
        request given no seed gets one (its audio reproducible)."""
        if request.options.get("denoise") and self.tokenizer is not None and not self.denoiser:
            raise Refused(ErrorKind.INVALID, "option 'options.denoise' needs a server started with --load-denoiser")
        text = self.spoken(request, pin)
        if not text:
            raise Refused(ErrorKind.INVALID, "field 'text' has nothing to say after whitespace cleanup")
        if self.tokenizer is not None and (request.prepared or not request.options.get("normalize")):
            positions, tokens = prompt_positions(self.tokenizer, text, pin)
            if not fits(positions, tokens, request.options.get("max_len", DEFAULTS["max_len"]), self.slot_positions):
                raise Refused(ErrorKind.TOO_LARGE, f"text and voice prompt take {positions} positions; with the "
                                                   f"audio they need, the model's {self.slot_positions} are not "
                                                   "enough: send a shorter text")
        if "seed" not in request.options:
            # A fixed seed per request keeps its audio reproducible; the client may choose it.
            request.options = {**request.options, "seed": secrets.randbits(63)}

    def spoken(self, request: GenerationRequest, voice_pin: dict | None) -> str:
        """What the model is given to say: the text, cleaned, behind its instructions in
        parentheses where this voice follows them (a continued segment takes none again)."""
        text = clean_text(request.text)
        instructions = clean_text(request.instructions or "")
        if instructions and text and request.context is None and self.follows_instructions(voice_pin):
            return f"({instructions}){text}"
        return text

    def follows_instructions(self, voice_pin: Any = None) -> bool:
        # VoxCPM2 reads "(description)text" as voice design, or with a reference-only voice as
        # style control; a voice with a transcript continues its prompt and takes none.
        return voice_pin is None or voice_pin.get("mode") == "reference"
