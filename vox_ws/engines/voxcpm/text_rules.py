"""How VoxCPM2 takes text (`Engine.text`): normalised on request (Chinese and English), cut at
sentence ends into pieces whose prompt fits a KV slot, "(description)text" for instructions."""

from __future__ import annotations

from typing import Any

from ...engine import GenerationRequest, TextRules
from ...text import base_language, pack
from .normalizer import Normalizer
from .options import DEFAULTS
from .prompt import clean_text, prompt_positions

# The languages the package's text normaliser has grammars for ("en" also stands for a text
# whose language is not said: the normaliser then tells Chinese from English itself).
NORMALIZED_LANGUAGES = ("zh", "en")


class VoxCPMText(TextRules):
    def __init__(self, engine: Any, normalizer: Normalizer) -> None:
        super().__init__(engine)
        self.normalizer = normalizer

    def needs_preparing(self, options: dict[str, Any], language: str | None = None) -> bool:
        # Text in a language the normaliser has no grammar for is spoken as written (its
        # numbers would be read out in English).
        return bool(options.get("normalize")) and base_language(language) in NORMALIZED_LANGUAGES

    def prepare(self, text: str, options: dict[str, Any], language: str | None = None) -> str:
        return self.normalizer.normalize(clean_text(text))

    def split(self, text: str, options: dict[str, Any], voice_pin: Any = None,
              language: str | None = None) -> list[str]:
        engine = self.engine
        if engine.runner is None:
            return [text]
        model = engine.tts.tts_model
        max_len = options.get("max_len", DEFAULTS["max_len"])
        # Normalisation comes later and may lengthen a piece (digits spelled out): leave room.
        growth = 2 if options.get("normalize") else 1

        def fits(piece: str) -> bool:
            positions, tokens = prompt_positions(model, clean_text(piece), voice_pin)
            return engine.runner.fits(positions + (growth - 1) * tokens, growth * tokens, max_len)

        return pack(text, fits, language)

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
