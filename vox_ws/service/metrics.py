"""Prometheus metrics for one server, in its own registry (no global state)."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections import OrderedDict
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..engine import Readiness

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
_STEP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0)
# Owners given series of their own in the usage counters: the most recent; an owner beyond them
# takes the place of the one unseen the longest, whose usage so far moves into the series of
# OTHER_OWNERS (so that every sum over the series only grows).
MAX_OWNER_SERIES = 256
OTHER_OWNERS = "other"


def owner_label(owner: str, secret: bytes) -> str:
    """The label an owner's usage is counted under: an HMAC of it under the server's secret, so
    that no one without the secret can tell whose it is (an unkeyed hash of an address or a weak
    token is undone by hashing guesses)."""
    return hmac.new(secret, owner.encode(), hashlib.sha256).hexdigest()[:24]


class Metrics:
    def __init__(self, secret: bytes | None = None) -> None:
        """`secret`: what owners' labels are keyed by (`--metrics-secret`; replicas that share
        it label an owner alike); None: a random one (labels change at each start)."""
        self._secret = secret if secret is not None else os.urandom(32)
        self.registry = CollectorRegistry()
        r = self.registry
        self.first_audio = Histogram("voxws_first_audio_seconds", "Stream start to first chunk queued",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.chunk_gap = Histogram("voxws_chunk_interarrival_seconds", "Time between consecutive chunks of a stream",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("voxws_step_seconds", "One engine step (all requests in its batch)",
                                   buckets=_STEP_BUCKETS, registry=r)
        self.step_period = Histogram("voxws_step_period_seconds", "Time from one engine step to the next, "
                                     "measured in the engine's process", buckets=_STEP_BUCKETS, registry=r)
        self.batch_size = Histogram("voxws_batch_size", "Requests advanced by one engine step",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.audio_seconds = Counter("voxws_audio_seconds",
                                     "Seconds of audio generated for streams (counted as the engine yields it)",
                                     registry=r)
        self.audio_bytes = Counter("voxws_audio_bytes", "Bytes of audio handed to clients, by output format",
                                   ["format"], registry=r)
        self.streams = Counter("voxws_streams", "Streams ended, by reason", ["reason"], registry=r)
        self.errors = Counter("voxws_errors", "Error messages sent, by code", ["code"], registry=r)
        self.cancellations = Counter("voxws_cancellations", "Streams cancelled by their client", registry=r)
        self.reaped = Counter("voxws_sessions_reaped", "Connections closed for idleness", registry=r)
        self.rejected = Counter("voxws_connections_rejected", "Connections refused, by reason", ["reason"],
                                registry=r)
        self.active = Gauge("voxws_active_streams", "Streams holding a generation slot", registry=r)
        self.queued = Gauge("voxws_queued_streams", "Streams waiting for a slot", registry=r)
        self.sessions = Gauge("voxws_open_sessions", "Open WebSocket sessions", registry=r)
        self.ready = Gauge("voxws_ready", "1 when the engine is loaded and the server accepts streams", registry=r)
        # Per device (one engine loop and model copy each; `index` tells two of a kind apart).
        self.device_active = Gauge("voxws_device_active_streams", "Streams holding a slot, per device",
                                   ["index", "device"], registry=r)
        self.device_queued = Gauge("voxws_device_queued_streams", "Streams waiting for a slot, per device",
                                   ["index", "device"], registry=r)
        self.device_up = Gauge("voxws_device_up", "1 while the device's engine serves", ["index", "device"], registry=r)
        self.device_restarts = Gauge("voxws_engine_restarts", "Times the device's engine process was started "
                                     "again after it died", ["index", "device"], registry=r)
        # Usage per owner (`owner_label`: keyed by the server's secret), for billing and quotas.
        self.owner_characters = Counter("voxws_owner_characters", "Characters of text taken in, per owner",
                                        ["owner"], registry=r)
        self.owner_audio_seconds = Counter("voxws_owner_audio_seconds", "Seconds of audio sent, per owner",
                                           ["owner"], registry=r)
        # Labels, the least recent first, with what each has counted: [characters, audio seconds].
        self._owners: OrderedDict[str, list[float]] = OrderedDict()

    def bind(self, active: Callable[[], float], queued: Callable[[], float], sessions: Callable[[], float],
             ready: Callable[[], float]) -> None:
        """Gauges read live state at scrape time."""
        self.active.set_function(active)
        self.queued.set_function(queued)
        self.sessions.set_function(sessions)
        self.ready.set_function(ready)

    def bind_device(self, index: int, device: str, stats: Callable[[], dict]) -> None:
        labels = (str(index), device)
        self.device_active.labels(*labels).set_function(lambda: stats()["active"])
        self.device_queued.labels(*labels).set_function(lambda: stats()["queued"])
        self.device_up.labels(*labels).set_function(lambda: 1.0 if stats()["status"] == Readiness.READY else 0.0)
        self.device_restarts.labels(*labels).set_function(lambda: stats().get("restarts", 0))

    def count_usage(self, owner: str, characters: int, audio_s: float) -> None:
        """A stream's usage, under its owner's series (`owner`: "token:…", "address:…"). At most
        MAX_OWNER_SERIES series, of the owners seen last: a scrape stays bounded whoever connects,
        and an owner that arrives early cannot keep a series from the ones active now."""
        label = owner_label(owner, self._secret)
        if label in self._owners:
            self._owners.move_to_end(label)
        else:
            if len(self._owners) >= MAX_OWNER_SERIES:
                gone, (gone_characters, gone_audio_s) = self._owners.popitem(last=False)
                self.owner_characters.remove(gone)
                self.owner_audio_seconds.remove(gone)
                self.owner_characters.labels(OTHER_OWNERS).inc(gone_characters)
                self.owner_audio_seconds.labels(OTHER_OWNERS).inc(gone_audio_s)
            self._owners[label] = [0.0, 0.0]
        counted = self._owners[label]
        counted[0] += characters
        counted[1] += audio_s
        self.owner_characters.labels(label).inc(characters)
        self.owner_audio_seconds.labels(label).inc(audio_s)

    def observe_step(self, batch: int, seconds: float) -> None:
        self.step_time.observe(seconds)
        self.batch_size.observe(batch)

    def observe_period(self, seconds: float) -> None:
        self.step_period.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
