"""The open-loop capacity benchmark (`vox_ws.clients.capacity`, `vox-ws bench --rate`): its arithmetic,
and runs against real servers. What it measures depends on the machine; these tests check only
what holds on any: every listener arriving is served and counted, lengths are what was asked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vox_ws.clients import capacity
from vox_ws.clients.playback import playback_gaps


def test_a_player_hears_a_gap_when_a_chunk_comes_after_the_audio_before_it_has_played():
    arrivals = [(10.0, 0.5), (10.4, 0.5), (11.2, 0.3), (11.3, 1.0), (12.7, 0.1)]
    # Playing from 10.0: due again at 10.5, then 11.0; 11.2 is 0.2 s late; from 11.2 due at
    # 11.5, then 12.5; 12.7 is 0.2 s late.
    assert playback_gaps(arrivals) == pytest.approx([0.2, 0.2])
    assert playback_gaps([(0.0, 1.0), (0.5, 1.0)]) == []
    assert playback_gaps([]) == []


def summary(rate: float, p95_ms: float, gap_free: float, listeners: float) -> dict:
    return {"rate_per_s": rate, "streams": 10, "first_audio_ms": {"p50": 1.0, "p95": p95_ms, "p99": p95_ms},
            "gap_free_share": gap_free, "concurrent_listeners": listeners}


def test_the_capacity_is_the_highest_rate_within_both_targets():
    rates = [summary(1, 80, 1.0, 3.0), summary(2, 120, 0.995, 6.0), summary(4, 250, 0.98, 12.0),
             summary(8, 900, 0.5, 20.0)]
    assert capacity.capacity(rates) == {"rate_per_s": 2, "concurrent_listeners": 6.0}
    # A higher rate that holds after one that did not still counts (noise between rates).
    rates.append(summary(3, 290, 0.99, 9.0))
    assert capacity.capacity(rates) == {"rate_per_s": 3, "concurrent_listeners": 9.0}
    assert capacity.capacity([summary(1, 301, 1.0, 2.0)]) is None


def test_texts_are_sized_in_seconds_of_speech():
    import random

    rng = random.Random(1)
    for seconds in (3.0, 9.0, 15.0):
        text = capacity.text_of(rng, seconds)
        longest = max(map(len, capacity.SENTENCES))
        assert seconds * capacity.CHARS_PER_SECOND <= len(text) <= seconds * capacity.CHARS_PER_SECOND + longest + 1


@pytest.mark.slow
async def test_listeners_arriving_at_random_on_the_tiny_voxcpm_get_the_length_they_asked_for(tiny_voxcpm):
    steps = await capacity.steps_per_second(tiny_voxcpm.url)
    assert steps is not None and steps > 0
    result = await capacity.run_rate(tiny_voxcpm.url, rate=4.0, duration=2.0, steps_per_s=steps,
                                     speech_s=(0.5, 2.0), seed=3)
    assert result.listeners, "the seed gives arrivals within the two seconds"
    for listener in result.listeners:
        assert listener.error is None
        # min_len = max_len: exactly the steps asked for, in audio.
        assert listener.audio_s == pytest.approx(round(listener.speech_s * steps) / steps, abs=1e-6)
        assert listener.first_audio_s is not None and listener.ended is not None
    s = result.summary()
    assert s["streams"] == len(result.listeners) and not s["errors"]
    assert 0.0 <= s["gap_free_share"] <= 1.0 and s["concurrent_listeners"] > 0
    assert result.load and s["slots"] == tiny_voxcpm.server.service.devices.slots
    # They came from addresses of their own, as from many machines.
    assert capacity.source_addresses(tiny_voxcpm.url)[0] == "127.0.0.2"


@pytest.mark.slow
def test_bench_rate_prints_the_capacity_and_writes_json_and_a_chart(piper_server, tmp_path):
    result = subprocess.run([sys.executable, "-m", "vox_ws", "bench", "--url", piper_server.url, "--rate", "1,2",
                             "--duration", "2", "--json", str(tmp_path / "c.json"), "--chart",
                             str(tmp_path / "c.png"), "--label", "piper"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "c.json").read_text())
    assert [r["rate_per_s"] for r in report["rates"]] == [1.0, 2.0]
    assert report["steps_per_s"] is None                   # Piper speaks its text, however long
    for rate in report["rates"]:
        assert rate["streams"] >= 1 and not rate["errors"] and rate["first_audio_ms"]["p50"] > 0
    assert "capacity: " in result.stdout and "gap-free" in result.stdout
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
