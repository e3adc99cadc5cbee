"""Registered voices in a store: the rules (ids by content, owners, caps) in every store — memory,
a directory, a real redis-server — then servers that share one: a voice survives a restart,
is usable through another replica, and an unreachable store fails voice operations only."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import WAIT_TIMEOUT, connect_client, wait_until
from helpers import register, speak, tiny_server, tone_wav
from vox_ws.engine import ErrorKind, Refused
from vox_ws.service.voices.directory_store import DirectoryStore
from vox_ws.service.voices.memory_store import MemoryStore
from vox_ws.service.voices.redis_store import RedisStore
from vox_ws.service.voices.store import (
    ANY_OWNER,
    Lifetime,
    StoredVoice,
    StoreLimits,
    StoreUnavailable,
    _digest_id,
    is_registered_id,
    new_voice,
    owner_key,
    rekey_named,
)

LIMITS = StoreLimits(per_owner=2, max_voices=4, max_bytes=200_000)


@pytest.fixture(params=["memory", "dir", "redis"])
async def store(request, tmp_path, redis_server):
    if request.param == "memory":
        made = MemoryStore(LIMITS)
    elif request.param == "dir":
        made = DirectoryStore(tmp_path / "voices", LIMITS)
        await made.open()
    else:
        made = RedisStore(redis_server.url, LIMITS)
        await made._redis.flushdb()
        await made.open()
    yield made
    await made.close()


def voice(owner: str, pitch: float, seconds: float = 0.5):
    return new_voice(owner, tone_wav(seconds, pitch=pitch), "A transcript.", "both")


async def test_the_rules_hold_in_every_store(store):
    alice = [voice("token:alice", 200 + n) for n in range(3)]
    assert await store.put(alice[0]) == [] and await store.put(alice[1]) == []
    # The same content from the same owner is the same voice; from another owner another one.
    assert voice("token:alice", 200).id == alice[0].id
    assert voice("token:bob", 200).id != alice[0].id
    assert await store.put(voice("token:alice", 200)) == []
    # Alice's third retires her oldest, no one else's.
    assert await store.put(alice[2]) == [alice[0].id]
    assert await store.get(alice[0].id) is None
    stored = await store.get(alice[1].id)
    assert stored.audio == alice[1].audio and stored.transcript == "A transcript." and stored.mode == "both"
    assert stored.owner == owner_key("token:alice") != "token:alice"       # no token is stored
    # An owner is shown its own voices, oldest first, without their audio; no one else's.
    listed = await store.owned_by("token:alice")
    assert [(v.id, v.mode, v.transcript, v.audio_bytes) for v in listed] == \
        [(v.id, "both", "A transcript.", len(v.audio)) for v in alice[1:]]
    assert listed[0].created <= listed[1].created
    assert await store.owned_by("token:bob") == []
    # Full (4 voices): refused, nothing evicted.
    await store.put(voice("token:bob", 300))
    await store.put(voice("token:carol", 300))
    with pytest.raises(Refused) as full:
        await store.put(voice("token:dave", 300))
    assert full.value.kind == ErrorKind.BUSY
    # The forecast says the same before any work: a newcomer is refused; Alice, at her cap,
    # would retire her oldest; a voice already kept stays as it is.
    with pytest.raises(Refused) as forecast:
        await store.check_room(voice("token:dave", 300))
    assert forecast.value.kind == ErrorKind.BUSY
    await store.check_room(voice("token:alice", 250))
    await store.check_room(voice("token:bob", 300))
    assert (await store.usage())["voices"] == 4
    # Only the owner (or an admin) deletes.
    assert await store.delete(alice[1].id, "token:bob") is False
    assert await store.delete(alice[1].id, "token:alice") is True
    assert [v.id for v in await store.owned_by("token:alice")] == [alice[2].id]
    assert await store.delete(alice[2].id, ANY_OWNER) is True
    assert await store.delete(alice[2].id, ANY_OWNER) is False
    # The byte cap: 200 kB; a 6 s reference is 192 kB (16-bit, 16 kHz) beside the 32 kB kept.
    assert (await store.usage())["voices"] == 2
    with pytest.raises(Refused, match="bytes"):
        await store.check_room(voice("token:erin", 300, seconds=6.0))
    with pytest.raises(Refused, match="bytes"):
        await store.put(voice("token:erin", 300, seconds=6.0))


def computed_id(owner: str, name: str) -> str:
    """What a named voice's id was before the store kept a secret: a hash of public inputs, which
    any client could compute (Hardening V, finding 1)."""
    return _digest_id(hashlib.sha256(), b"vox-ws named voice", owner_key(owner).encode(), name.encode())


def named(store, owner: str, name: str, pitch: float = 240.0) -> StoredVoice:
    return new_voice(owner, tone_wav(0.5, pitch=pitch), None, "reference",
                     named=(name, store.named_id(owner_key(owner), name)))


async def test_a_named_voices_id_is_made_under_the_stores_secret_and_speaks_for_its_owner_only(store):
    owner, other = "address:127.0.0.3", "address:127.0.0.2"
    mine = named(store, owner, "me")
    assert await store.put(mine) == []
    assert is_registered_id(mine.id) and mine.id == store.named_id(owner_key(owner), "me")
    # Not what a client computes from the owner and the name, nor what another store makes.
    assert mine.id != computed_id(owner, "me") and await store.get(computed_id(owner, "me")) is None
    assert MemoryStore(LIMITS).named_id(owner_key(owner), "me") != mine.id
    # Its owner and an admin speak with it; nobody else, even holding its id.
    assert await store.usable(mine.id, owner) and await store.usable(mine.id, ANY_OWNER)
    assert not await store.usable(mine.id, other)
    assert store.usable_now(mine.id, other) in (False, None)            # None: the store must be asked
    assert store.usable_now(mine.id, owner) in (True, None)
    # A voice registered without a name is a capability: its id (made from its audio) speaks.
    unnamed = voice("token:a", 250)
    await store.put(unnamed)
    assert await store.usable(unnamed.id, other) and store.usable_now(unnamed.id, other) in (True, None)
    assert not await store.usable("v_" + "a" * 32, owner)


def public(store, owner: str, name: str, pitch: float = 240.0) -> StoredVoice:
    return dataclasses.replace(named(store, owner, name, pitch), public=True)


async def resolved(store, owner: str, name: str) -> str:
    """The id `owner` speaks with by `name`: as the store tells without waiting where it can,
    and as it answers when asked (the two agree)."""
    own = store.named_id(owner_key(owner), name)
    asked = await store.public.resolve(own, name, owner)
    assert store.public.resolve_now(own, name, owner) in (asked, None)
    return asked


async def test_a_public_voice_is_anyones_by_its_name_and_only_its_owners_to_change_in_every_store(store):
    """Issue 60, 7: a voice registered with a token was its owner's only, and so invisible to
    Open WebUI (another token) and Wyoming (no token). Its owner may now make it public: kept
    with the flag, listed, and spoken by its name by anyone; only its owner unpublishes or
    deletes it, and the default (private) is unchanged."""
    alice, bob, wyoming = "token:alice", "token:bob", "address:127.0.0.2"
    shared = public(store, alice, "narrator")
    private = named(store, alice, "diary", pitch=260.0)
    await store.put(shared)
    await store.put(private)
    assert (await store.get(shared.id)).public and not (await store.get(private.id)).public
    assert [(v.id, v.public) for v in await store.owned_by(alice)] == [(shared.id, True), (private.id, False)]
    assert [v.name for v in await store.public.listed()] == ["narrator"]
    # Anyone speaks it by its name, and by its id; the private one stays its owner's.
    for caller in (bob, wyoming):
        assert await resolved(store, caller, "narrator") == shared.id
        assert await store.usable(shared.id, caller)
        assert not await store.usable(private.id, caller)
        assert await resolved(store, caller, "diary") == store.named_id(owner_key(caller), "diary")
    assert await store.public.id("narrator") == shared.id and await store.public.id("diary") is None
    # A caller's own voice of that name comes first, for it.
    bobs = named(store, bob, "narrator", pitch=300.0)
    await store.put(bobs)
    assert await resolved(store, bob, "narrator") == bobs.id
    assert await resolved(store, wyoming, "narrator") == shared.id
    # A public name is one voice's: another owner's public voice of that name is refused.
    with pytest.raises(Refused) as taken:
        await store.put(public(store, "token:carol", "narrator", pitch=310.0))
    assert taken.value.kind == ErrorKind.INVALID and taken.value.field == "name"
    with pytest.raises(Refused, match="another public voice"):
        await store.public.set(bobs.id, bob, True)
    assert not (await store.get(bobs.id)).public
    # A public voice needs a name; an unnamed one cannot be made public either.
    with pytest.raises(Refused) as nameless:
        await store.put(dataclasses.replace(voice(bob, 320.0), public=True))
    assert nameless.value.field == "name"
    unnamed = voice(bob, 330.0)
    await store.put(unnamed)
    with pytest.raises(Refused, match="needs a name"):
        await store.public.set(unnamed.id, bob, True)
    # Only its owner (or an admin) unpublishes it: another owner's voice looks like no voice.
    assert await store.public.set(shared.id, bob, False) is None
    assert await store.delete(shared.id, bob) is False
    hidden = await store.public.set(shared.id, alice, False)
    assert hidden is not None and hidden.public is False and hidden.name == "narrator"
    assert await store.public.listed() == [] and await store.public.id("narrator") is None
    assert not await store.usable(shared.id, wyoming)
    assert await resolved(store, wyoming, "narrator") == store.named_id(owner_key(wyoming), "narrator")
    # Published again, then deleted by its owner: gone from the list and from its name.
    assert (await store.public.set(shared.id, ANY_OWNER, True)).public
    assert await store.delete(shared.id, alice) is True
    assert await store.public.listed() == [] and await store.public.id("narrator") is None
    # Its name is free again for another owner's public voice.
    assert (await store.public.set(bobs.id, bob, True)).public
    assert await resolved(store, wyoming, "narrator") == bobs.id


@pytest.mark.hardening
async def test_public_names_that_read_the_same_are_one_name_in_every_store(store):
    """Hardening VII, 6: `narrator` beside another owner's public `Narrator` (and fullwidth
    `ＮＡＲＲＡＴＯＲ`) were accepted and listed to everyone. A public name is now one voice's by
    its normal form (NFKC, case folded), in every store (Redis atomically, by its scripts), and
    found by any spelling that reads the same; another name is served beside it."""
    first = public(store, "token:alice", "Narrator")
    await store.put(first)
    for owner, name, pitch in (("token:bob", "narrator", 300.0),
                               ("token:carol", "ＮＡＲＲＡＴＯＲ", 310.0)):
        with pytest.raises(Refused, match="another public voice"):
            await store.put(public(store, owner, name, pitch))
        kept = named(store, owner, name, pitch)
        await store.put(kept)                                     # kept privately: its owner's name
        with pytest.raises(Refused, match="another public voice"):
            await store.public.set(kept.id, owner, True)
    assert await store.public.id("narrator") == first.id == await store.public.id("ＮＡＲＲＡＴＯＲ")
    other = public(store, "token:bob", "Narrator two", 320.0)
    await store.put(other)
    assert [v.name for v in await store.public.listed()] == ["Narrator", "Narrator two"]
    assert await store.delete(first.id, "token:alice")
    assert await store.public.id("narrator") is None                # the name is free again
    assert (await store.public.set(named(store, "token:bob", "narrator", 300.0).id, "token:bob", True)).public


async def test_redis_public_names_an_earlier_version_indexed_as_given_move_to_their_normal_form(redis_server):
    """A Redis store whose `public` hash an earlier version keyed by the name as given (no
    `name_key` on the voice) is keyed by the normal form once a server opens it: the voice is
    found by any spelling, and a look-alike is refused."""
    made = RedisStore(redis_server.url, LIMITS)
    await made._redis.flushdb()
    await made.open()
    old = public(made, "token:alice", "Narrator")
    await made.put(old)
    index = made._key("public")
    await made._redis.hdel(index, "narrator")                      # as the earlier version kept it
    await made._redis.hset(index, "Narrator", old.id)
    await made._redis.hdel(made._key("voice", old.id), "name_key")
    await made.close()
    reopened = RedisStore(redis_server.url, LIMITS)
    await reopened.open()
    try:
        assert await reopened._redis.hgetall(index) == {b"narrator": old.id.encode()}
        assert await reopened.public.id("NARRATOR") == old.id
        with pytest.raises(Refused, match="another public voice"):
            await reopened.put(public(reopened, "token:bob", "narrator", 300.0))
        assert await reopened.delete(old.id, "token:alice") and await reopened._redis.hgetall(index) == {}
    finally:
        await reopened.close()


async def test_a_public_voice_keeps_its_owners_cap_and_expiry_in_every_store(quota_store):
    """A public voice has no place in the store that its owner's others lack: one beyond the
    owner's cap retires its oldest, public or not, and an anonymous owner's expires with its
    others (else publishing would let a handful of addresses keep the store's places for good)."""
    store, now = quota_store
    await store.open()
    owner = "address:10.1.0.1"

    def made(name: str, pitch: float, shared: bool = True) -> StoredVoice:
        now[0] += 1.0
        made = new_voice(owner, tone_wav(0.2, pitch=pitch), None, "reference",
                         Lifetime(QUOTA_LIMITS.ttl_s, store.clock),
                         named=(name, store.named_id(owner_key(owner), name)))
        return dataclasses.replace(made, public=shared)

    first = made("first", 200.0)
    assert first.expires == now[0] + QUOTA_LIMITS.ttl_s
    await store.put(first)
    await store.put(made("second", 210.0, shared=False))
    third = made("third", 220.0)
    assert await store.put(third) == [first.id]                    # the per-address cap: 2
    assert [v.name for v in await store.public.listed()] == ["third"]
    assert await store.public.id("first") is None
    now[0] += QUOTA_LIMITS.ttl_s
    assert await store.public.listed() == [] and await store.public.id("third") is None
    assert third.id in await store.expire()


@pytest.mark.hardening
async def test_an_expired_public_voice_frees_its_name_at_once_in_every_store(quota_store):
    """Issue 71, found on the way: in Redis, a public voice whose time was up kept its name
    taken from every other owner until the next sweep (`_SET_PUBLIC` asked only whether the
    holder's key was still there). Now its name is free the moment it expires, sweep or not:
    another owner's voice of that name is made public, and is the one its name speaks."""
    store, now = quota_store
    await store.open()
    visitor, bob = "address:10.2.0.1", "token:bob"
    now[0] += 1.0
    gone = dataclasses.replace(new_voice(visitor, tone_wav(0.2, pitch=200.0), None, "reference",
                                         Lifetime(QUOTA_LIMITS.ttl_s, store.clock),
                                         named=("narrator", store.named_id(owner_key(visitor), "narrator"))),
                               public=True)
    await store.put(gone)
    bobs = named(store, bob, "narrator", 260.0)
    await store.put(bobs)
    with pytest.raises(Refused, match="another public voice"):
        await store.public.set(bobs.id, bob, True)                  # while the visitor's is alive
    now[0] += QUOTA_LIMITS.ttl_s                                    # its time is up; no sweep
    assert (await store.public.set(bobs.id, bob, True)).public
    assert await store.public.id("narrator") == bobs.id
    assert await resolved(store, "token:carol", "narrator") == bobs.id


async def test_a_directory_store_of_the_previous_version_opens_with_its_voices_private(tmp_path):
    """A voice's JSON file holds `public` only where it is true: a private voice's file is the
    one the previous version wrote and read, and a file without the field is a private voice."""
    path = tmp_path / "voices"
    store = DirectoryStore(path, LIMITS)
    await store.open()
    private, shared = named(store, "token:a", "mine"), public(store, "token:a", "ours", pitch=250.0)
    await store.put(private)
    await store.put(shared)
    previous = {"id", "transcript", "mode", "owner", "created", "name", "anonymous", "expires", "network"}
    assert set(json.loads((path / f"{private.id}.json").read_text())) == previous
    assert json.loads((path / f"{shared.id}.json").read_text())["public"] is True
    await store.public.set(shared.id, "token:a", False)          # written through
    await store.public.set(private.id, "token:a", True)
    again = DirectoryStore(path, LIMITS)
    await again.open()
    assert (await again.get(shared.id)).public is False and (await again.get(private.id)).public is True
    assert await again.public.id("mine") == private.id and await again.public.id("ours") is None


async def test_the_secret_is_kept_with_the_voices_and_shared_by_replicas(tmp_path, redis_server):
    owner = "token:a"
    first = DirectoryStore(tmp_path / "v", LIMITS)
    await first.open()
    secret = tmp_path / "v" / "secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and secret.stat().st_size == 32
    again = DirectoryStore(tmp_path / "v", LIMITS)
    await again.open()                                          # a restart: the same ids
    assert again.named_id(owner_key(owner), "me") == first.named_id(owner_key(owner), "me")
    elsewhere = DirectoryStore(tmp_path / "w", LIMITS)
    await elsewhere.open()
    assert elsewhere.named_id(owner_key(owner), "me") != first.named_id(owner_key(owner), "me")
    # A secret others may read is no secret: the store refuses to open, saying what to do.
    os.chmod(secret, 0o644)
    with pytest.raises(StoreUnavailable, match="no one else may read"):
        await DirectoryStore(tmp_path / "v", LIMITS).open()
    # Unread, a store names no voice (it would name the wrong one).
    with pytest.raises(StoreUnavailable):
        DirectoryStore(tmp_path / "x", LIMITS).named_id(owner_key(owner), "me")
    # Replicas on one Redis: the first to open makes the secret, every one reads the same.
    stores = [RedisStore(redis_server.url, LIMITS) for _ in range(3)]
    try:
        await stores[0]._redis.flushdb()
        await asyncio.gather(*(s.open() for s in stores))
        assert len({s.named_id(owner_key(owner), "me") for s in stores}) == 1
        assert stores[0].named_id(owner_key(owner), "me") != first.named_id(owner_key(owner), "me")
    finally:
        for made in stores:
            await made.close()


async def test_named_voices_kept_under_computable_ids_move_to_their_new_ids(store):
    owner = "token:a"
    old = new_voice(owner, tone_wav(0.5, pitch=260), None, "reference", named=("me", computed_id(owner, "me")))
    plain = voice("token:b", 270)
    await store.put(old)
    await store.put(plain)
    assert await rekey_named(store) == [old.id]
    assert await store.get(old.id) is None
    moved = await store.get(store.named_id(owner_key(owner), "me"))
    assert (moved.audio, moved.name, moved.owner, moved.created) == (old.audio, "me", old.owner, old.created)
    assert (await store.get(plain.id)).audio == plain.audio
    assert await rekey_named(store) == []


async def test_a_directory_store_survives_a_restart(tmp_path):
    first = DirectoryStore(tmp_path / "v", LIMITS)
    await first.open()
    kept = voice("token:a", 220)
    await first.put(kept)
    again = DirectoryStore(tmp_path / "v", LIMITS)
    await again.open()
    assert (await again.get(kept.id)).audio == kept.audio
    (tmp_path / "v" / "v_broken.json").write_text("{not json")       # a crash's leftovers are skipped
    await DirectoryStore(tmp_path / "v", LIMITS).open()


async def test_redis_keeps_voices_across_its_restart(redis_server):
    store = RedisStore(redis_server.url, LIMITS)
    await store._redis.flushdb()
    kept = voice("token:a", 230)
    await store.put(kept)
    await store.close()
    redis_server.restart()
    store = RedisStore(redis_server.url, LIMITS)
    try:
        assert (await store.get(kept.id)).audio == kept.audio
    finally:
        await store.close()


QUOTA_LIMITS = StoreLimits(per_owner=3, max_voices=8, max_bytes=1_000_000, per_address=2, ttl_s=100.0)


async def _store_on_a_clock(kind: str, limits: StoreLimits, tmp_path, redis_server):
    """A store of `kind` with `limits`, on a clock the test moves: (store, [now])."""
    now = [1_000_000.0]
    clock = lambda: now[0]                                          # noqa: E731
    if kind == "memory":
        made = MemoryStore(limits, clock)
    elif kind == "dir":
        made = DirectoryStore(tmp_path / "voices", limits, clock)
        await made.open()
    else:
        made = RedisStore(redis_server.url, limits, clock)
        await made._redis.flushdb()
    return made, now


@pytest.fixture(params=["memory", "dir", "redis"])
async def quota_store(request, tmp_path, redis_server):
    """A store with per-address quotas and expiry, on a clock the test moves."""
    made, now = await _store_on_a_clock(request.param, QUOTA_LIMITS, tmp_path, redis_server)
    yield made, now
    await made.close()


async def test_addresses_have_a_small_quota_and_their_voices_expire_in_every_store(quota_store):
    store, now = quota_store

    def made(owner: str, pitch: float):
        now[0] += 1.0                                               # each one later: "oldest" is clear
        return new_voice(owner, tone_wav(0.2, pitch=pitch), None, "reference",
                         lifetime=Lifetime(QUOTA_LIMITS.ttl_s, store.clock))

    # A token keeps 3; an address 2 (its third retires its own oldest), each for 100 s.
    tokens = [made("token:t", 200 + n) for n in range(3)]
    for v in tokens:
        assert v.expires is None and not v.anonymous
        assert await store.put(v) == []
    first, second, third = (made("address:10.0.0.1", 300 + n) for n in range(3))
    assert first.anonymous and first.expires == first.created + 100.0
    assert await store.put(first) == [] and await store.put(second) == []
    await store.check_room(third)                                   # at its cap: retires, not refused
    assert await store.put(third) == [first.id]
    other = made("address:10.0.2.2", 400)
    await store.put(other)
    assert (await store.usage())["voices"] == 6
    # An admin sees every voice with its owner's key, and deletes one owner's.
    listed = await store.every_voice()
    assert [v.id for v in listed] == [*(v.id for v in tokens), second.id, third.id, other.id]
    assert {v.owner for v in listed} == {owner_key("token:t"), owner_key("address:10.0.0.1"),
                                         owner_key("address:10.0.2.2")}
    assert await store.delete_owned(owner_key("address:10.0.2.2")) == [other.id]
    assert await store.get(other.id) is None
    # 100 s after they were registered the address's voices are gone; the token's stay.
    now[0] = second.created + 100.0
    assert await store.get(second.id) is None and not await store.has(second.id)
    assert [v.id for v in await store.owned_by("address:10.0.0.1")] == [third.id]
    assert await store.delete(second.id, ANY_OWNER) is False
    now[0] = third.created + 100.0
    assert await store.owned_by("address:10.0.0.1") == [] and len(await store.every_voice()) == 3
    assert sorted(await store.expire()) == sorted([second.id, third.id])
    assert await store.expire() == []
    assert await store.usage() == {"voices": 3, "bytes": sum(len(v.audio) for v in tokens)}
    assert [(await store.get(v.id)).id for v in tokens] == [v.id for v in tokens]
    # A put lets go of what expired too (the service deletes those ids everywhere).
    late = made("address:10.0.3.3", 500)
    await store.put(late)
    now[0] = late.created + 100.0
    assert await store.put(made("address:10.0.4.4", 501)) == [late.id]


SHARE_LIMITS = StoreLimits(per_owner=4, max_voices=64, max_bytes=10_000_000, per_address=2, ttl_s=100.0)


@pytest.fixture(params=["memory", "dir", "redis"])
async def share_store(request, tmp_path, redis_server):
    """A store whose shares are small: 4 voices without a token a network, 32 in all."""
    made, now = await _store_on_a_clock(request.param, SHARE_LIMITS, tmp_path, redis_server)
    yield made, now
    await made.close()


async def test_addresses_share_the_store_by_network_and_never_lock_out_tokens(share_store):
    """Hardening V, 6: 64 addresses (of one IPv6 /64, or IPv4) filled `max_voices` in seconds,
    and every new owner was refused for a day. Now voices without a token hold at most a
    sixteenth of the store per network (an IPv4 /24, an IPv6 /48) and half of it in all."""
    store, now = share_store
    assert (SHARE_LIMITS.per_network, SHARE_LIMITS.anonymous) == (4, 32)
    pitch = iter(range(100, 10_000, 7))

    def made(owner: str):
        now[0] += 1.0
        return new_voice(owner, tone_wav(0.2, pitch=next(pitch)), None, "reference",
                         lifetime=Lifetime(SHARE_LIMITS.ttl_s, store.clock))

    async def refused(voice) -> str:
        with pytest.raises(Refused) as forecast:
            await store.check_room(voice)
        with pytest.raises(Refused) as put:
            await store.put(voice)
        assert forecast.value.kind is put.value.kind is ErrorKind.BUSY
        return put.value.message

    # Two addresses of one /24 fill its share; a third of that network is refused, not others.
    for address in ("10.0.0.1", "10.0.0.2"):
        for _ in range(2):
            assert await store.put(made(f"address:{address}")) == []
    assert "your network" in await refused(made("address:10.0.0.3"))
    # An owner at its quota still retires its own oldest (its network's count stays).
    oldest = (await store.owned_by("address:10.0.0.1"))[0].id
    assert await store.put(made("address:10.0.0.1")) == [oldest]
    # IPv6: owners of one /48 share it (each owner a /64, as `addresses.client_key` keys them).
    for owner in ("address:2001:db8:0:1::/64", "address:2001:db8:0:2::/64"):
        for _ in range(2):
            await store.put(made(owner))
    assert "your network" in await refused(made("address:2001:db8:0:3::/64"))
    await store.put(made("address:2001:db8:1::/64"))                # another /48
    # Networks fill the half of the store voices without a token may hold: 32 in all.
    assert (await store.usage())["voices"] == 9
    for network in range(23):                                       # one voice each of 23 more networks
        assert await store.put(made(f"address:10.{network + 10}.0.1")) == []
    assert (await store.usage())["voices"] == 32
    assert "share of the store" in await refused(made("address:10.30.0.1"))
    # Clients with tokens are never locked out by them; and when theirs expire, places come back.
    assert await store.put(made("token:t")) == []
    now[0] += SHARE_LIMITS.ttl_s
    assert await store.put(made("address:10.30.0.1")) != []           # the expired ones let go
    assert await store.put(made("address:10.0.0.3")) == []


# ------------------------------------------------------------------ servers on one store


@pytest.mark.slow                        # over 4.5 s: the full lane's
async def test_a_voice_in_a_directory_store_speaks_after_a_restart(start_server, tiny_model, tmp_path):
    store = f"dir:{tmp_path / 'voices'}"
    first = tiny_server(start_server, tiny_model, store)
    voice_id = await register(first)
    before = await speak(first, voice_id)
    first.stop()
    second = tiny_server(start_server, tiny_model, store)          # a new process would do the same
    after = await speak(second, voice_id)
    assert after.end["reason"] == "max_len"
    np.testing.assert_allclose(after.pcm(), before.pcm(), atol=1e-4)
    plain = await speak(second, None)
    assert not np.allclose(plain.pcm(), after.pcm(), atol=1e-4)


async def test_replicas_on_one_redis_share_voices(start_server, tiny_model, redis_server):
    import redis.asyncio

    client = redis.asyncio.from_url(redis_server.url)
    await client.flushdb()
    await client.aclose()
    a = tiny_server(start_server, tiny_model, redis_server.url)
    b = tiny_server(start_server, tiny_model, redis_server.url)
    voice_id = await register(a)
    on_a = await speak(a, voice_id)
    on_b = await speak(b, voice_id)                 # b builds the prompt on first use
    assert on_b.error is None and on_b.end["reason"] == "max_len"
    np.testing.assert_allclose(on_b.pcm(), on_a.pcm(), atol=1e-4)
    # Deleted through a: b no longer speaks it (it asks the shared store).
    async with connect_client(a) as c:
        await c.send({"type": "voice_delete", "id": "d", "voice": voice_id})
        assert (await c.recv_where(lambda m: m.get("id") == "d"))["deleted"] is True
    gone = await speak(b, voice_id)
    assert gone.error is not None and gone.error["code"] == "bad_request" and voice_id in gone.error["message"]


@pytest.mark.hardening                   # a fault: the full lane's
async def test_an_unreachable_store_fails_voice_operations_only(start_server, tiny_model, tmp_path):
    from conftest import RedisServer

    redis = RedisServer(str(tmp_path))
    server = tiny_server(start_server, tiny_model, redis.url)
    voice_id = await register(server)
    redis.stop()
    async with connect_client(server) as c:
        await c.send({"type": "voice", "id": "r", "audio": tone_wav(1.0, pitch=250)})
        error = await c.recv_where(lambda m: m.get("id") == "r")
        assert error["type"] == "error" and error["code"] == "not_ready" and error["retryable"]
        assert "voice store is unavailable" in error["message"]
        failed = await c.speak("With a stored voice.", "v", voice=voice_id, options={"max_len": 2})
        assert failed.error["code"] == "not_ready"
        # Streams without a registered voice are not affected.
        fine = await c.speak("Without one.", "p", options={"max_len": 3, "seed": 1})
        assert fine.end["reason"] == "max_len"
    redis.start()
    again = await speak(server, voice_id)
    assert again.end["reason"] == "max_len"
    redis.stop()


@pytest.mark.slow
@pytest.mark.hardening                   # a fault: the full lane's
async def test_a_shared_store_unreachable_at_start_opens_when_it_comes_back(start_server, tiny_model, tmp_path):
    """Named voices need the store's secret: a server started while Redis is down answers
    them `not_ready` (never a 500), serves built-in voices, and opens the store once it is back."""
    from conftest import RedisServer

    redis = RedisServer(str(tmp_path))
    redis.stop()
    server = tiny_server(start_server, tiny_model, redis.url)
    store = server.server.service.voices.store
    try:
        assert not store.opened
        answer = httpx.post(server.http + "/v1/audio/speech", timeout=60,
                            json={"model": "tts-1", "voice": "me", "input": "Hello.", "response_format": "pcm"})
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "not_ready", answer.text
        async with connect_client(server) as c:
            named = await c.speak("Hello.", "n", voice="me", options={"max_len": 2})
            assert named.error["code"] == "not_ready" and named.error["retryable"]
            assert (await c.speak("Hello.", "b", options={"max_len": 2})).end["reason"] == "max_len"
        redis.start()
        await wait_until(lambda: store.opened)          # the sweeper tries it again each second
        made = httpx.post(server.http + "/v1/voices", params={"name": "me"}, content=tone_wav(1.0, pitch=260),
                          headers={"content-type": "audio/wav"}, timeout=60)
        assert made.status_code == 201, made.text
        assert (await speak(server, "me")).end["reason"] == "max_len"
    finally:
        redis.stop()


async def test_same_audio_twice_is_one_voice_over_the_wire(start_server, tiny_model):
    server = tiny_server(start_server, tiny_model, "memory")
    first, second = await register(server, pitch=300), await register(server, pitch=300)
    assert first == second
    assert await register(server, pitch=301) != first


@pytest.mark.slow
async def test_a_full_store_refuses_before_the_prompt_is_built(start_server, tiny_model):
    server = tiny_server(start_server, tiny_model, "memory", max_voices=1)
    engine = server.server.devices.engines[0]
    built = []
    register_voice = engine.voices.register

    def counting(*args, **kwargs):
        built.append(args[-1])
        return register_voice(*args, **kwargs)

    engine.voices.register = counting                 # the real method, counted
    first = await register(server, pitch=300)
    assert built == [first]
    async with connect_client(server) as c:
        await c.send({"type": "voice", "id": "r", "audio": tone_wav(1.0, pitch=320),
                      "transcript": "The reference says this."})
        refused = await c.recv_where(lambda m: m.get("id") == "r")
    assert refused["type"] == "error" and refused["code"] == "busy", refused
    assert built == [first]                           # no VAE pass was spent on it
    assert await register(server, pitch=300) == first  # the voice kept is registered again as is


# ------------------------------------------------------------------ OpenAI-shaped voice routes


@pytest.mark.slow
async def test_openai_shaped_voice_routes_register_list_speak_and_delete_per_owner(start_server, tiny_model):
    """`/v1/audio/voices` as vLLM-Omni's clients use it, through the `openai` SDK's own request
    methods: each owner (a token) sees the built-in voices and its own, never another's."""
    import openai

    server = tiny_server(start_server, tiny_model, "memory", tokens=["alice-token", "bob-token"])
    alice = openai.OpenAI(base_url=server.http + "/v1", api_key="alice-token", max_retries=0)
    bob = openai.OpenAI(base_url=server.http + "/v1", api_key="bob-token", max_retries=0)
    multipart = {"headers": {"Content-Type": "multipart/form-data"}}

    def upload(client: openai.OpenAI, pitch: float, **fields) -> dict:
        return client.post("/audio/voices", cast_to=object, options=multipart, body=fields,
                           files=[("audio_sample", ("sample.wav", tone_wav(1.0, pitch=pitch), "audio/wav"))])

    builtin = (await asyncio.to_thread(alice.get, "/audio/voices", cast_to=object))
    assert builtin["uploaded_voices"] == []
    assert [v["id"] for v in builtin["voices"] if v["kind"] == "builtin"] == server.server.service.voices.listed()
    assert all(v["id"] and v["name"] for v in builtin["voices"])          # what Open WebUI reads
    added = await asyncio.to_thread(upload, alice, 210.0, name="teller", consent="consent-1",
                                    ref_text="The reference says this.")
    assert added["success"] is True
    voice = added["voice"]
    # The name is kept: it is what the voice is listed and spoken by; its id is made from it.
    assert voice["name"] == voice["id"] == "teller" and is_registered_id(voice["voice_id"])
    assert voice["mode"] == "both" and voice["ref_text"] == "The reference says this."
    assert voice["file_size"] == len(tone_wav(1.0, pitch=210.0)) and voice["audio_s"] == 1.0
    # The same operation as POST /v1/voices: the same audio under the same name is the same voice.
    again = httpx.post(server.http + "/v1/voices?transcript=The%20reference%20says%20this.&name=teller",
                       content=tone_wav(1.0, pitch=210.0),
                       headers={"Content-Type": "audio/wav", "Authorization": "Bearer alice-token"})
    assert again.status_code == 201 and again.json() == {**again.json(), "voice": voice["voice_id"], "name": "teller"}
    # Other audio under a name the owner has used: refused, naming the field; the voice stays.
    with pytest.raises(openai.BadRequestError) as taken:
        await asyncio.to_thread(upload, alice, 330.0, name="teller")
    assert "named 'teller' already" in taken.value.body["message"]

    listed = await asyncio.to_thread(alice.get, "/audio/voices", cast_to=object)
    assert listed["voices"][:len(builtin["voices"])] == builtin["voices"]
    assert [(v["id"], v["name"], v["kind"]) for v in listed["voices"][len(builtin["voices"]):]] == \
        [("teller", "teller", "uploaded")]
    assert [v["name"] for v in listed["uploaded_voices"]] == ["teller"]
    assert (await asyncio.to_thread(bob.get, "/audio/voices", cast_to=object))["uploaded_voices"] == []

    def say(client: openai.OpenAI, name: str) -> bytes:
        return client.audio.speech.create(model="tts-1", voice=name, input="In the uploaded voice.",
                                          response_format="pcm", extra_body={"max_len": 4}).content
    assert len(await asyncio.to_thread(say, alice, "teller")) > 0
    assert len(await asyncio.to_thread(say, alice, voice["voice_id"])) > 0       # by its id too
    with pytest.raises(openai.BadRequestError) as not_bobs:        # a name is its owner's only
        await asyncio.to_thread(say, bob, "teller")
    assert not_bobs.value.body["code"] == "voice_not_found" and "'teller'" in not_bobs.value.body["message"]

    # Another owner's voice looks like no voice; the same errors as /v1/voices.
    with pytest.raises(openai.NotFoundError) as missing:
        await asyncio.to_thread(bob.delete, "/audio/voices/teller", cast_to=object)
    assert missing.value.body["code"] == "bad_request"
    with pytest.raises(openai.BadRequestError) as no_audio:
        await asyncio.to_thread(alice.post, "/audio/voices", cast_to=object, options=multipart,
                                body={"name": "x"}, files=[("other", ("a.txt", b"text", "text/plain"))])
    assert "'audio'" in no_audio.value.body["message"]
    deleted = await asyncio.to_thread(alice.delete, "/audio/voices/teller", cast_to=object)
    assert deleted["success"] is True and deleted["deleted"] is True and deleted["voice"] == "teller"
    assert (await asyncio.to_thread(alice.get, "/audio/voices", cast_to=object))["uploaded_voices"] == []
    with pytest.raises(openai.BadRequestError):
        await asyncio.to_thread(say, alice, "teller")


def from_address(address: str, token: str | None = None) -> httpx.AsyncClient:
    """An HTTP client of its own address (another machine's, as Open WebUI is)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address=address), headers=headers,
                             timeout=WAIT_TIMEOUT)


OPEN_WEBUI_SPEECH = {"model": "tts-1", "input": "In the public voice.", "max_len": 4}


@pytest.mark.slow
async def test_a_public_voice_is_listed_and_spoken_by_open_webui_from_another_address(start_server,
                                                                                       tiny_model):
    """Issue 60, 7: with --token, a voice cloned with one token was invisible to Open WebUI (its
    own token, from its own address), though the README said it listed uploaded voices. Now its
    owner registers it `public` (over v1), and Open WebUI's requests list it and speak it by
    name; a private voice stays invisible; unpublished, it is hidden again; only its owner
    changes or deletes it."""
    from vox_ws.clients.v1 import VoxError, connect

    server = tiny_server(start_server, tiny_model, "memory", tokens=["alice-token", "webui-token"])
    async with connect(server.url, token="alice-token") as alice:
        await alice.register_voice(tone_wav(1.0, pitch=210.0), name="narrator", public=True)
        await alice.register_voice(tone_wav(1.0, pitch=250.0), name="diary")
        with pytest.raises(VoxError) as nameless:                # a public voice is spoken by its name
            await alice.register_voice(tone_wav(1.0, pitch=260.0), public=True)
        assert nameless.value.code == "bad_request" and "needs a name" in nameless.value.message

    async with from_address("127.0.0.2", "webui-token") as webui, from_address("127.0.0.2") as keyless, \
            from_address("127.0.0.1", "alice-token") as owner:
        async def listed(client: httpx.AsyncClient) -> dict[str, str]:
            answer = await client.get(server.http + "/v1/audio/voices")
            assert answer.status_code == 200, answer.text
            return {v["id"]: v["kind"] for v in answer.json()["voices"]
                    if v["kind"] not in ("builtin", "alias")}

        async def spoken(name: str) -> httpx.Response:
            return await webui.post(server.http + "/v1/audio/speech",
                                    json={**OPEN_WEBUI_SPEECH, "voice": name, "response_format": "pcm"})

        # Open WebUI's list (with its key, or none) shows the public voice by name, not the private one.
        assert await listed(webui) == {"narrator": "public"} == await listed(keyless)
        assert await listed(owner) == {"narrator": "uploaded", "diary": "uploaded"}
        mine = (await owner.get(server.http + "/v1/audio/voices")).json()["uploaded_voices"]
        assert [(v["name"], v["public"]) for v in mine] == [("narrator", True), ("diary", False)]
        plain = (await webui.get(server.http + "/v1/voices")).json()["voices"]
        assert [v["id"] for v in plain if v["kind"] == "public"] == ["narrator"]
        said = await spoken("narrator")
        assert said.status_code == 200 and len(said.content) > 0, said.text
        refused = await spoken("diary")
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "voice_not_found"

        # Its name is taken for public voices; Open WebUI's owner cannot change or delete it.
        taken = await webui.post(server.http + "/v1/audio/voices",
                                 data={"name": "narrator", "public": "true"},
                                 files={"audio_sample": ("a.wav", tone_wav(1.0, pitch=300.0), "audio/wav")})
        assert taken.status_code == 400, taken.text
        assert "another public voice" in taken.json()["error"]["message"]
        for path in ("/v1/voices/narrator", "/v1/audio/voices/narrator"):
            assert (await webui.patch(server.http + path, json={"public": False})).status_code == 404
            assert (await webui.delete(server.http + path)).status_code == 404
        assert (await webui.patch(server.http + "/v1/voices/diary", json={"public": True})).status_code == 404
        bad = await owner.patch(server.http + "/v1/voices/narrator", json={"public": "no"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_request"

        # Unpublished by its owner: hidden and unspoken again; published again over v1.
        hidden = await owner.patch(server.http + "/v1/voices/narrator", json={"public": False})
        assert hidden.status_code == 200 and hidden.json()["public"] is False, hidden.text
        assert await listed(webui) == {} and (await spoken("narrator")).status_code == 400
        async with connect(server.url, token="alice-token") as alice:
            assert await alice.set_voice_public("narrator", True) is True
            assert await alice.set_voice_public("nobody", True) is False
        assert await listed(webui) == {"narrator": "public"}
        assert (await spoken("narrator")).status_code == 200
        # Deleted by its owner: gone for everyone.
        assert (await owner.delete(server.http + "/v1/audio/voices/narrator")).status_code == 200
        assert await listed(webui) == {} and (await spoken("narrator")).status_code == 400


@pytest.mark.slow
async def test_a_public_voice_registered_through_one_replica_is_spoken_by_name_through_another(
        start_server, tiny_model, redis_server):
    """A shared store tells which voice a name is only when asked: the stream asks it before it
    speaks, and speaks the public voice another owner registered through another replica."""
    import redis.asyncio

    client = redis.asyncio.from_url(redis_server.url)
    await client.flushdb()
    await client.aclose()
    a = tiny_server(start_server, tiny_model, redis_server.url, tokens=["alice-token", "bob-token"])
    b = tiny_server(start_server, tiny_model, redis_server.url, tokens=["alice-token", "bob-token"])
    alice, bob = ({"additional_headers": {"Authorization": f"Bearer {token}"}}
                  for token in ("alice-token", "bob-token"))
    async with connect_client(a, **alice) as c:
        await c.send({"type": "voice", "id": "r", "audio": tone_wav(1.0, pitch=190.0), "name": "narrator",
                      "public": True})
        assert (await c.recv_where(lambda m: m.get("id") == "r"))["public"] is True
        await c.send({"type": "voice", "id": "p", "audio": tone_wav(1.0, pitch=230.0), "name": "diary"})
        assert (await c.recv_where(lambda m: m.get("id") == "p"))["public"] is False
    options = {"seed": 9, "max_len": 4}
    async with connect_client(a, **alice) as c:
        owners = await c.speak("Speak in the stored voice.", "s", voice="narrator", options=options)
    async with connect_client(b, **bob) as c:
        bobs = await c.speak("Speak in the stored voice.", "s", voice="narrator", options=options)
        private = await c.speak("Speak in the stored voice.", "t", voice="diary", options=options)
    assert bobs.error is None and bobs.end["reason"] == "max_len"
    np.testing.assert_allclose(bobs.pcm(), owners.pcm(), atol=1e-4)
    assert private.error is not None and private.error["code"] == "bad_request"
    assert "'diary'" in private.error["message"]
    async with connect_client(b, **alice) as c:                 # the owner, through the other replica
        await c.send({"type": "voice_update", "id": "u", "voice": "narrator", "public": False})
        assert (await c.recv_where(lambda m: m.get("id") == "u"))["updated"] is True
    async with connect_client(a, **bob) as c:
        gone = await c.speak("Speak in the stored voice.", "s", voice="narrator", options=options)
    assert gone.error is not None and gone.error["code"] == "bad_request"


ADMIN = "admin-secret"


@pytest.mark.slow
async def test_a_handful_of_addresses_cannot_fill_the_store_for_good(start_server, tiny_model):
    """The attack: a few addresses registering voices until `max_voices` is reached, for good.
    Now each address keeps its quota (2 here, 4 by default), voices without a token hold half
    the store (6 of 12 here), an admin lists and deletes by owner
    over REST and v1, and token-less voices expire (the store's clock moved past the TTL)."""
    server = tiny_server(start_server, tiny_model, "memory", max_voices=12, max_voices_per_address=2,
                         admin_tokens=[ADMIN])
    service = server.server.service
    now = [time.time()]
    service.voices.store.clock = lambda: now[0]

    def client(address: str, **headers: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=server.http, headers=headers,
                                 transport=httpx.AsyncHTTPTransport(local_address=address))

    async def upload(address: str, pitch: float) -> httpx.Response:
        now[0] += 1.0
        async with client(address) as http:
            return await http.post("/v1/voices", content=tone_wav(1.0, pitch=pitch),
                                   headers={"content-type": "audio/wav"})

    kept: dict[str, list[str]] = {}
    for n in (1, 2, 3):
        address = f"127.0.{30 + n}.1"          # each of its own network
        ids = []
        for k in range(3):                                          # the third retires the first
            created = await upload(address, 150 + 10 * n + k)
            assert created.status_code == 201, created.text
            ids.append(created.json()["voice"])
        kept[address] = ids[1:]
    assert (await service.voices.store.usage())["voices"] == 6
    full = await upload("127.0.34.1", 300)
    assert full.status_code == 429 and full.json()["error"]["code"] == "busy", full.text
    # The owner sees when each of its voices expires.
    async with client("127.0.31.1") as http:
        mine = (await http.get("/v1/audio/voices")).json()["uploaded_voices"]
    assert [v["voice_id"] for v in mine] == kept["127.0.31.1"]
    assert all(v["expires_at"] == pytest.approx(now[0] + 86400, abs=10) for v in mine)
    # An admin over REST: everyone's voices with their owners' keys, and one owner's deleted.
    async with client("127.0.0.1", Authorization=f"Bearer {ADMIN}") as admin, client("127.0.0.1") as anyone:
        assert (await anyone.get("/v1/admin/voices")).status_code == 403
        assert (await anyone.delete("/v1/admin/voices", params={"address": "127.0.31.1"})).status_code == 403
        listing = (await admin.get("/v1/admin/voices")).json()
        assert sorted(v["voice"] for v in listing["voices"]) == sorted(sum(kept.values(), []))
        assert listing["usage"]["voices"] == 6
        assert (await admin.get("/v1/admin/voices", params={"address": "nonsense"})).status_code == 400
        assert (await admin.delete("/v1/admin/voices")).status_code == 400
        gone = await admin.delete("/v1/admin/voices", params={"address": "127.0.31.1"})
        assert gone.status_code == 200 and sorted(gone.json()["deleted"]) == sorted(kept["127.0.31.1"])
    for voice in kept["127.0.31.1"]:
        assert not service.engine.voices.has(voice)
    assert (await upload("127.0.34.1", 300)).status_code == 201     # room again
    # The same over protocol v1, only on an admin connection.
    async with connect_client(server) as c:
        await c.send({"type": "voice_admin", "id": "a", "op": "list"})
        assert (await c.error("a"))["code"] == "unauthorized"
    async with connect_client(server, additional_headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        await c.send({"type": "voice_admin", "id": "b", "op": "wipe"})
        assert (await c.error("b"))["code"] == "bad_request"
        await c.send({"type": "voice_admin", "id": "c", "op": "delete"})
        assert (await c.error("c"))["code"] == "bad_request"
        await c.send({"type": "voice_admin", "id": "d", "op": "list", "address": "127.0.32.1"})
        listed = await c.recv_where(lambda m: m.get("id") == "d")
        assert [v["voice"] for v in listed["voices"]] == kept["127.0.32.1"], listed
        owner = listed["voices"][0]["owner"]
        await c.send({"type": "voice_admin", "id": "e", "op": "delete", "owner": owner})
        deleted = await c.recv_where(lambda m: m.get("id") == "e")
        assert deleted["type"] == "voice_admin" and sorted(deleted["deleted"]) == sorted(kept["127.0.32.1"])
    # A day later the token-less voices are gone: unknown to streams at once, then swept from
    # every device; a newcomer registers, and a built-in voice speaks as before.
    victim = kept["127.0.33.1"][0]
    assert service.engine.voices.has(victim)
    now[0] += 86400.0 + 10
    async with connect_client(server) as c:
        expired = await c.speak("Hello.", "x", voice=victim, options={"max_len": 3})
    assert expired.error is not None and "unknown voice" in expired.error["message"], expired.error
    swept = asyncio.run_coroutine_threadsafe(service.voices.expire(), server.loop).result(30)
    assert victim in swept or not service.engine.voices.has(victim)
    assert not service.engine.voices.has(victim) and (await service.voices.store.usage())["voices"] == 0
    assert (await upload("127.0.35.1", 310)).status_code == 201
    result = await speak(server, None)
    assert result.error is None and result.end is not None


@pytest.mark.slow
async def test_a_named_voice_is_its_owners_whether_named_or_given_by_id(start_server, tiny_model):
    """The attack (Hardening V, finding 1): 127.0.0.2 computes the id of the voice 127.0.0.3
    registered as "me" (and of the admin's "narrator") from public inputs and speaks with it
    over OpenAI and v1. Now the id is made under the store's secret, and even an id that leaked
    speaks for its owner (and an admin) only."""
    server = tiny_server(start_server, tiny_model, "memory", admin_tokens=[ADMIN])

    def http(address: str, **headers: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=server.http, headers=headers, timeout=60,
                                 transport=httpx.AsyncHTTPTransport(local_address=address))

    async def register_named(client: httpx.AsyncClient, name: str, pitch: float) -> str:
        made = await client.post("/v1/voices", params={"name": name}, content=tone_wav(1.0, pitch=pitch),
                                 headers={"content-type": "audio/wav"})
        assert made.status_code == 201, made.text
        return made.json()["voice"]

    async def over_openai(client: httpx.AsyncClient, voice: str) -> httpx.Response:
        return await client.post("/v1/audio/speech", json={"model": "tts-1", "voice": voice, "input": "Hello there.",
                                                            "response_format": "pcm", "max_len": 3})

    async def over_v1(address: str, voice: str, **kwargs) -> dict:
        async with connect_client(server, local_addr=(address, 0), **kwargs) as c:
            result = await c.speak("Hello there.", "s", voice=voice, options={"max_len": 3})
        return result.error or result.end

    async with http("127.0.0.3") as owner, http("127.0.0.2") as other, \
            http("127.0.0.1", Authorization=f"Bearer {ADMIN}") as admin:
        mine = await register_named(owner, "me", 210.0)
        narrator = await register_named(admin, "narrator", 230.0)
        computed = computed_id("address:127.0.0.3", "me")
        assert mine != computed and narrator != computed_id(ANY_OWNER, "narrator")
        for voice in (computed, computed_id(ANY_OWNER, "narrator"), mine, narrator):
            refused = await over_openai(other, voice)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "voice_not_found", refused.text
            error = await over_v1("127.0.0.2", voice)
            assert error["code"] == "bad_request" and "unknown voice" in error["message"], error
        # Its owner speaks with it by name and by id; an admin too; and the attacker's own voice.
        for voice in ("me", mine):
            assert (await over_openai(owner, voice)).status_code == 200
            assert (await over_v1("127.0.0.3", voice))["reason"] == "max_len"
        assert (await over_openai(admin, narrator)).status_code == 200
        assert (await over_v1("127.0.0.1", narrator, additional_headers={"Authorization": f"Bearer {ADMIN}"})
                )["reason"] == "max_len"
        theirs = await register_named(other, "me", 250.0)
        assert theirs not in (mine, computed_id("address:127.0.0.2", "me"))
        assert (await over_openai(other, "me")).status_code == 200


@pytest.mark.slow
async def test_many_addresses_of_one_network_cannot_lock_new_owners_out(start_server, tiny_model):
    """Hardening V, 6, the attack: 64 addresses (of one /64, or IPv4) filled `max_voices` in
    seconds, and every new owner was refused for `--voice-ttl`. Here 32 addresses of one /24
    try 2 voices each against `max_voices` 64: their network keeps its share (4), and a new
    owner of another network and an admin register."""
    server = tiny_server(start_server, tiny_model, "memory", max_voices=64, max_voices_per_address=2,
                         admin_tokens=[ADMIN])

    async def upload(address: str, pitch: float, **headers: str) -> int:
        async with httpx.AsyncClient(base_url=server.http, headers=headers, timeout=60,
                                     transport=httpx.AsyncHTTPTransport(local_address=address)) as http:
            made = await http.post("/v1/voices", content=tone_wav(1.0, pitch=pitch),
                                   headers={"content-type": "audio/wav"})
            assert made.status_code in (201, 429), made.text
            return made.status_code

    codes = [await upload(f"127.0.0.{40 + n}", 150 + 2 * n + k) for n in range(32) for k in range(2)]
    assert codes.count(201) == 4 and codes.count(429) == 60
    assert (await server.server.service.voices.store.usage())["voices"] == 4
    assert await upload("127.0.1.1", 400) == 201
    assert await upload("127.0.0.1", 410, Authorization=f"Bearer {ADMIN}") == 201


@pytest.mark.hardening
async def test_a_redis_that_refuses_writes_is_not_ready_and_every_request_is_answered(start_server, tiny_model,
                                                                                        tmp_path, caplog):
    import redis.asyncio

    from conftest import RedisServer
    from helpers import tone_wav

    store = RedisServer(str(tmp_path))
    try:
        server = tiny_server(start_server, tiny_model, store.url)
        voice_id, doomed = await register(server), await register(server, pitch=230)
        admin = redis.asyncio.from_url(store.url)
        # OOM at maxmemory (writes refused, reads served), then READONLY (a replica after a
        # fail-over: its master here is a port nobody listens on).
        refusals = [("config", "set", "maxmemory", "1"), ("replicaof", "127.0.0.1", "1")]
        undo = [("config", "set", "maxmemory", "0"), ("replicaof", "no", "one")]
        for refuse, restore in zip(refusals, undo):
            await admin.execute_command(*refuse)
            async with connect_client(server) as c:
                await c.send({"type": "voice", "id": "r", "audio": tone_wav(1.0, pitch=260)})
                error = await c.recv_where(lambda m: m.get("id") == "r")
                assert error["type"] == "error" and error["code"] == "not_ready" and error["retryable"], error
                if refuse[0] == "replicaof":            # (at maxmemory, deleting is allowed)
                    await c.send({"type": "voice_delete", "id": "d", "voice": doomed})
                    error = await c.recv_where(lambda m: m.get("id") == "d")
                    assert error["type"] == "error" and error["code"] == "not_ready", error
            response = await asyncio.to_thread(httpx.post, server.http + "/v1/voices", content=tone_wav(1.0, pitch=270),
                                               headers={"Content-Type": "audio/wav"}, timeout=WAIT_TIMEOUT)
            assert response.status_code == 503 and response.headers["Retry-After"], response.text
            assert response.json()["error"]["code"] == "not_ready"
            spoken = await speak(server, voice_id)                     # reads are still served
            assert spoken.error is None and spoken.end["reason"] == "max_len", spoken.error
            await admin.execute_command(*restore)
        assert await register(server, pitch=280)                       # writes again
        await admin.aclose()
    finally:
        store.stop()
    unhandled = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert unhandled == [], [r.getMessage() for r in unhandled]


@pytest.mark.hardening
def test_the_built_voices_are_a_cache_the_least_recently_used_leave(monkeypatch):
    from vox_ws.engines.voxcpm import voices

    monkeypatch.setattr(voices, "MAX_VOICES", 3)
    book = voices.VoiceBook()
    book.add({"n": "builtin"}, name="narrator")
    for n in range(3):
        book.add({"n": n}, voice_id=f"v{n}")
    assert book.get("v0") == {"n": 0}                     # used: now the most recent
    book.add({"n": 3}, voice_id="v3")
    assert book.get("v1") is None and len(book) == 3      # the least recently used left
    assert [book.get(v)["n"] for v in ("v0", "v2", "v3")] == [0, 2, 3]
    for n in range(4, 10):
        book.add({"n": n}, voice_id=f"v{n}")
    assert len(book) == 3 and book.get("narrator") == {"n": "builtin"}     # built-ins stay


@pytest.mark.hardening
async def test_voice_churn_through_one_replica_never_fills_another(start_server, tiny_model, redis_server,
                                                                  monkeypatch):
    """The voices B's engine keeps built stay within its cap: read on the engine's side of the
    boundary (its host's engine, served on a thread of this process, where the cap is set), the
    server holding only the engine as declared."""
    import redis.asyncio

    from vox_ws.engines.voxcpm import voices

    cap = 4
    monkeypatch.setattr(voices, "MAX_VOICES", cap)
    client = redis.asyncio.from_url(redis_server.url)
    await client.flushdb()
    await client.aclose()
    a = tiny_server(start_server, tiny_model, redis_server.url, max_voices_per_owner=2)
    b = tiny_server(start_server, tiny_model, redis_server.url, max_voices_per_owner=2)
    registered = []
    # Each cycle registers a new voice on A (which retires the owner's oldest beyond 2) and
    # speaks with it once on B: three times B's capacity.
    for cycle in range(3 * cap):
        registered.append(await register(a, pitch=150.0 + 10 * cycle))
        spoken = await speak(b, registered[-1])
        assert spoken.error is None and spoken.end["reason"] == "max_len", (cycle, spoken.error)
    (engine_b_loop,) = b.devices.loops
    engine_b = engine_b_loop.launcher.host.engine
    assert len(engine_b.voices.book) <= cap
    # A voice the store retired is refused on B too, whatever B had built.
    gone = await speak(b, registered[0])
    assert gone.error is not None and gone.error["code"] == "bad_request"
    # One still in the store that B dropped is built again from it.
    kept = await speak(b, registered[-2])
    assert kept.error is None and kept.end["reason"] == "max_len"


# ------------------------------------------------------------------ a directory store, private (Hardening VI)

# A store opened in a process of its own (a umask, a file size limit of its own), then one voice
# put: prints the voice's id, or the store's refusal (exit 3).
_STORE_CHILD = """
import asyncio, resource, signal, sys
from vox_ws.service.voices.directory_store import DirectoryStore
from vox_ws.service.voices.store import StoreLimits, StoreUnavailable, new_voice
path, audio, limit = sys.argv[1:4]
async def main():
    store = DirectoryStore(path, StoreLimits(per_owner=2, max_voices=4, max_bytes=200_000))
    if limit != "none":                # writes past it fail (EFBIG), as they do on a full disk (ENOSPC)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        await store.open()
    except StoreUnavailable as err:
        print(err.message)
        sys.exit(3)
    voice = new_voice("address:127.0.0.3", open(audio, "rb").read(), "A transcript.", "both")
    await store.put(voice)
    print(voice.id)
asyncio.run(main())
"""


def _store_child(store, audio, umask: int = 0o022, file_limit: int | None = None):
    limit = "none" if file_limit is None else str(file_limit)
    return subprocess.run([sys.executable, "-c", _STORE_CHILD, str(store), str(audio), limit],
                          capture_output=True, text=True, timeout=120, umask=umask, cwd=REPO,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
NOBODY = 65534


def nobody_reads(path) -> bool:
    """Whether another local user (uid 65534: `cat`, `ls` as it) reads a file or lists a directory."""
    command = ["ls", str(path)] if os.path.isdir(path) else ["cat", str(path)]
    return subprocess.run(command, user=NOBODY, group=NOBODY, capture_output=True, timeout=30).returncode == 0


@pytest.fixture
def reachable(tmp_path):
    """A directory every local user may enter (tmp_path is 0700): where another user's reads
    fail for the store's modes alone."""
    made = Path(tempfile.mkdtemp(prefix="vox-ws-store-"))
    os.chmod(made, 0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)


def modes(store) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [store, *store.iterdir()]}


@pytest.mark.hardening
async def test_a_directory_store_is_private_to_its_user_whatever_the_umask(reachable, tmp_path):
    """Hardening VI, 6: the store's directory and voices were made with the umask's modes (0755
    and 0644; 0777 and 0666 under umask 0): every local user read the recordings, transcripts
    and ids. They are 0700 and 0600 from their creation now, whatever the umask."""
    store = reachable / "data" / "voices"
    audio = tmp_path / "reference.wav"
    audio.write_bytes(tone_wav(0.5, pitch=235))
    made = _store_child(store, audio, umask=0o000)
    assert made.returncode == 0, made.stderr[-3000:]
    kept = made.stdout.strip()
    assert is_registered_id(kept)
    assert modes(store) == {"voices": 0o700, "secret": 0o600, f"{kept}.audio": 0o600, f"{kept}.json": 0o600}
    assert stat.S_IMODE(store.parent.stat().st_mode) == 0o700          # the parents it made too
    if AS_ROOT:                                                         # the attack itself
        (reachable / "open").write_text("anyone reads this")
        assert nobody_reads(reachable / "open")
        files = (store.parent, store, store / f"{kept}.json", store / f"{kept}.audio")
        assert not any(nobody_reads(p) for p in files)
    # The good request: the store read again (a restart) has the voice, and a new one is private too.
    again = DirectoryStore(store, LIMITS)
    await again.open()
    assert (await again.get(kept)).audio == audio.read_bytes()
    other = voice("token:b", 245)
    await again.put(other)
    assert {mode for name, mode in modes(store).items() if name.startswith(other.id)} == {0o600}


@pytest.mark.hardening
async def test_a_store_others_may_read_is_made_private_at_start_and_its_voices_still_speak(
        start_server, tiny_model, reachable, caplog):
    """Hardening VI, 6: a store an earlier version made (0755, voices 0644) stayed readable by
    every local user. A start tightens it (a warning says what was), and its voices speak on."""
    store = reachable / "voices"
    first = tiny_server(start_server, tiny_model, f"dir:{store}")
    kept = await register(first)
    before = await speak(first, kept)
    first.stop()
    os.chmod(store, 0o755)                                # as an earlier version left it
    for path in store.glob("v_*"):
        os.chmod(path, 0o644)
    if AS_ROOT:
        assert nobody_reads(store / f"{kept}.json")       # the attack, as it stood
    with caplog.at_level(logging.WARNING, "vox_ws.service"):
        second = tiny_server(start_server, tiny_model, f"dir:{store}")
    warned = [r.getMessage() for r in caplog.records if "made private" in r.getMessage()]
    assert len(warned) == 1 and "0755 -> 0700" in warned[0] and "2 voice files -> 0600" in warned[0], warned
    assert kept not in warned[0]                  # files named by count: a voice's files are named by its id
    assert modes(store) == {"voices": 0o700, "secret": 0o600, f"{kept}.audio": 0o600, f"{kept}.json": 0o600}
    if AS_ROOT:
        assert not nobody_reads(store) and not nobody_reads(store / f"{kept}.json")
    after = await speak(second, kept)
    assert after.end["reason"] == "max_len"
    np.testing.assert_allclose(after.pcm(), before.pcm(), atol=1e-4)


@pytest.mark.hardening
@pytest.mark.skipif(not AS_ROOT, reason="another user's store needs root to make (CI runs as root)")
async def test_a_store_another_user_owns_is_refused_in_one_line(tmp_path):
    """Hardening VI, 6: a store this server cannot make private (another user's: its owner
    reads it whatever its mode, and the server may not chmod it) is refused, in one line, before
    a model loads: `vox-ws serve` exits 1. Given back to the server's user, it opens."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    refused = subprocess.run([sys.executable, "-m", "vox_ws", "serve", "--engine", "piper", "--port", "0",
                              "--voice-store", f"dir:{theirs}"], capture_output=True, text=True, timeout=120,
                             cwd=REPO)
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert refused.stderr.splitlines() == [refused.stderr.strip()]
    assert refused.stderr.startswith("vox-ws serve: ")
    assert f"uid {NOBODY}'s" in refused.stderr and "chown it" in refused.stderr
    # Ours, holding a voice file of another user's (planted while it was open to them): refused too.
    ours = tmp_path / "ours"
    first = DirectoryStore(ours, LIMITS)
    await first.open()
    kept = voice("token:a", 225)
    await first.put(kept)
    os.chown(ours / f"{kept.id}.json", NOBODY, NOBODY)
    planted = r"1 of the voice files .* are not regular files of this user's"
    with pytest.raises(StoreUnavailable, match=planted) as caught:
        await DirectoryStore(ours, LIMITS).open()
    assert kept.id not in caught.value.message
    # The good request: both given back to this user, each opens and serves its voices.
    os.chown(ours / f"{kept.id}.json", os.geteuid(), os.getegid())
    os.chown(theirs, os.geteuid(), os.getegid())
    for path in (ours, theirs):
        again = DirectoryStore(path, LIMITS)
        await again.open()
        assert await again.get(kept.id) is not None or path == theirs
        await again.put(voice("token:b", 235))


@pytest.mark.hardening
async def test_a_secret_is_written_whole_or_not_at_all_and_one_cut_short_is_made_again(tmp_path, caplog):
    """Hardening VI, 12: the secret was written in place: a first start whose write failed (a
    full disk) left a 0-byte `secret`, and every later start exited 1 until someone deleted it.
    Now it is written beside and moved into place: a failed write leaves nothing, and the next
    start makes it. One an earlier version left cut short is made again (no voice was ever made
    under it: see `DirectoryStore._remade_secret`)."""
    store = tmp_path / "voices"
    audio = tmp_path / "reference.wav"
    audio.write_bytes(tone_wav(0.5, pitch=240))
    failed = _store_child(store, audio, file_limit=0)     # no byte may be written: the write fails
    assert failed.returncode == 3, failed.stderr[-3000:]
    assert "File too large" in failed.stdout and "secret" in failed.stdout
    assert list(store.iterdir()) == []                     # no `secret`, no temporary file
    # The good request: the next start makes the secret and keeps named voices under it.
    first = DirectoryStore(store, LIMITS)
    await first.open()
    secret = (store / "secret").read_bytes()
    assert len(secret) == 32 and modes(store)["secret"] == 0o600
    owner = "token:a"
    await first.put(named(first, owner, "me"))
    again = DirectoryStore(store, LIMITS)
    await again.open()
    assert await again.get(again.named_id(owner_key(owner), "me")) is not None
    # What an earlier version's failed write left, 0 bytes or some: a new secret, with a warning.
    for left in (b"", secret[:16]):
        (store / "secret").write_bytes(left)
        with caplog.at_level(logging.WARNING, "vox_ws.service"):
            remade = DirectoryStore(store, LIMITS)
            await remade.open()
        assert f"held {len(left)} of the secret's 32 bytes" in caplog.text
        made = (store / "secret").read_bytes()
        assert len(made) == 32 and made != secret and modes(store)["secret"] == 0o600
        caplog.clear()
    # A named voice kept under the secret it replaced moves to its id under the new one.
    assert await rekey_named(remade) == [first.named_id(owner_key(owner), "me")]
    assert await remade.get(remade.named_id(owner_key(owner), "me")) is not None
    # One longer than a secret is not one this server made, and one others may read is no secret.
    (store / "secret").write_bytes(made + b"x")
    with pytest.raises(StoreUnavailable, match="not a secret this server made"):
        await DirectoryStore(store, LIMITS).open()
    assert not [p for p in store.iterdir() if p.name.endswith(".partial")]
