"""`service/voices/lookalikes.py`: the normal form names are compared by, and names mixing scripts."""

from __future__ import annotations

import pytest

from vox_ws.engine import Refused
from vox_ws.service.voices.lookalikes import mixes_scripts, name_key
from vox_ws.service.voices.store import check_voice_name


@pytest.mark.hardening
def test_names_that_read_the_same_have_one_key_and_mixed_scripts_are_refused():
    """Hardening VII, 6: case, width and compatibility forms fold to one key; letters of
    scripts that pass for each other mixed in a name are refused, as UTS #39's highly
    restrictive level has it (Latin with Han and kana, Bopomofo or Hangul is one name); a name
    in any one script is a name."""
    assert name_key("Alloy") == name_key("ａｌｌｏｙ") == name_key("ALLOY") == "alloy"
    assert name_key("Straße") == name_key("STRASSE") and name_key("ﬁne") == "fine"
    assert name_key("аlloy") != "alloy"                   # Cyrillic а: another name, refused below
    for mixed in ("аlloy", "Narrаtor", "Ωmega", "Сaра", "ボイスΩ", "عربي abc"):
        assert mixes_scripts(mixed), mixed
        with pytest.raises(Refused, match="one script"):
            check_voice_name(mixed)
    for single in ("Alloy", "Ελένη", "Сара", "日本語のボイス", "my ボイス 2", "한국어 voice", "注音ㄅㄆ voice",
                   "Zoë's voice", "voice 1.5", "עברית"):
        assert not mixes_scripts(single), single
        assert check_voice_name(single) == single
