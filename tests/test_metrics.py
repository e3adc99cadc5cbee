"""`metrics.py` and `logs.py`: the Prometheus series and the one JSON log line per stream."""

from __future__ import annotations

import json
import logging
import re
import urllib.request

import pytest

from conftest import assert_good_stream, connect_client
from helpers import SENTENCE


@pytest.mark.hardening
async def test_metrics_and_structured_stream_log(piper_server, caplog):
    caplog.set_level(logging.INFO, logger="vox_ws.stream")
    async with connect_client(piper_server) as c:
        assert_good_stream(await c.speak(SENTENCE, "m"))
        await c.send(b"\xc1")
        await c.recv()
    with urllib.request.urlopen(piper_server.http + "/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    for name in ("voxws_first_audio_seconds_count", "voxws_chunk_interarrival_seconds_count",
                 "voxws_step_seconds_count", "voxws_batch_size_count", "voxws_audio_seconds_total",
                 "voxws_active_streams", "voxws_queued_streams", "voxws_open_sessions",
                 "voxws_cancellations_total", "voxws_sessions_reaped_total"):
        assert re.search(rf"^{name}(\{{.*\}})? ", text, re.M), name
    assert re.search(r'^voxws_errors_total\{code="bad_frame"\} [1-9]', text, re.M)
    assert re.search(r'^voxws_audio_bytes_total\{format="f32"\} [1-9]', text, re.M)
    assert float(re.search(r"^voxws_first_audio_seconds_count (\S+)", text, re.M).group(1)) >= 1
    records = [json.loads(r.getMessage()) for r in caplog.records if r.name == "vox_ws.stream"]
    mine = [r for r in records if r["id"] == "m"][-1]
    assert mine["event"] == "stream" and mine["reason"] == "done" and mine["chunks"] >= 1
    assert {"session", "engine", "audio_s", "ttfa_ms", "rtf", "text_chars"} <= set(mine)
