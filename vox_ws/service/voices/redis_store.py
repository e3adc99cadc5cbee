"""The voice store in Redis (`--voice-store redis://...`), shared by replicas: its rules kept
atomically by Lua scripts."""

from __future__ import annotations

import secrets
import time
from typing import Any, Callable

from ...engine import ErrorKind, Refused
from .lookalikes import name_key
from .store import (
    ANY_OWNER,
    SECRET_BYTES,
    PublicVoices,
    StoredVoice,
    StoreLimits,
    StoreUnavailable,
    VoiceStore,
    VoiceSummary,
    may_speak_with,
    nameless_public,
    owner_key,
    public_name_taken,
)

# Let go of one voice and every index of it. Defined first in each script that drops voices.
_DROP = """
local function drop(prefix, id)
  local key = prefix .. 'voice:' .. id
  local fields = redis.call('HMGET', key, 'owner', 'size', 'network', 'name', 'name_key')
  redis.call('DECRBY', prefix .. 'bytes', tonumber(fields[2] or '0'))
  local named = fields[5] or fields[4]
  if named and named ~= '' and redis.call('HGET', prefix .. 'public', named) == id then
    redis.call('HDEL', prefix .. 'public', named)
  end
  redis.call('DEL', key)
  redis.call('ZREM', prefix .. 'voices', id)
  redis.call('ZREM', prefix .. 'expiry', id)
  redis.call('ZREM', prefix .. 'anonymous', id)
  if fields[1] then redis.call('ZREM', prefix .. 'owner:' .. fields[1], id) end
  if fields[3] and fields[3] ~= '' then redis.call('ZREM', prefix .. 'network:' .. fields[3], id) end
end
"""

# Whether a voice is there and its time not up (a voice past its time stays until the next
# sweep, but is no one's any more: its public name is free). Defined in each script that asks.
_LIVE = """
local function live(prefix, id, now)
  local fields = redis.call('HMGET', prefix .. 'voice:' .. id, 'owner', 'expires')
  if not fields[1] then return false end
  return not (fields[2] and fields[2] ~= '' and tonumber(fields[2]) <= tonumber(now))
end
"""

# Drop the voices whose time is up (the `expiry` zset: id -> when), as a delete would. Needs
# `prefix` and `now` set; leaves their ids in `expired`.
_PURGE = """
local expired = redis.call('ZRANGEBYSCORE', prefix .. 'expiry', '-inf', now)
for _, old in ipairs(expired) do drop(prefix, old) end
"""

# ARGV: the key prefix, now. Returns the ids dropped.
_EXPIRE = _DROP + "local prefix, now = ARGV[1], ARGV[2]\n" + _PURGE + "return expired\n"

# Keep a voice in Redis under the rules, atomically: drop expired voices, retire the owner's
# oldest beyond its cap, refuse when the store (or, without a token, its share) is full, then
# write. KEYS: voices (zset id -> created), owner's (zset), bytes (counter), the voice (hash).
# ARGV: id, owner, created, size, the owner's cap, max_voices, max_bytes, audio, transcript,
# mode, the key prefix, the name ('' for none), anonymous ('1' or '0'), expires ('' for never),
# now, network ('' for an owner with a token), the anonymous share, the network's share, public
# ('1' or '0': then the `public` hash, the name's normal form -> id, names it), the name's normal
# form (`lookalikes.name_key`; '' for none). Returns {status, ids let go...}.
_PUT = _DROP + _LIVE + "local prefix, now = ARGV[11], ARGV[15]\n" + _PURGE + """
if redis.call('EXISTS', KEYS[4]) == 1 then table.insert(expired, 1, 'exists') return expired end
if ARGV[19] == '1' then
  if ARGV[12] == '' then table.insert(expired, 1, 'nameless') return expired end
  local holder = redis.call('HGET', prefix .. 'public', ARGV[20])
  if holder and holder ~= ARGV[1] and live(prefix, holder, now) then
    table.insert(expired, 1, 'name_taken') return expired
  end
end
local cap, max_voices, max_bytes = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local size = tonumber(ARGV[4])
local owned = redis.call('ZRANGE', KEYS[2], 0, -1)
local retire = {}
local freed_voices, freed_bytes = 0, 0
for i = 1, #owned - cap + 1 do
  local old = owned[i]
  table.insert(retire, old)
  freed_voices = freed_voices + 1
  freed_bytes = freed_bytes + tonumber(redis.call('HGET', prefix .. 'voice:' .. old, 'size') or '0')
end
local voices = redis.call('ZCARD', KEYS[1]) - freed_voices
local bytes = tonumber(redis.call('GET', KEYS[3]) or '0') - freed_bytes
if voices + 1 > max_voices then table.insert(expired, 1, 'full_voices') return expired end
if bytes + size > max_bytes then table.insert(expired, 1, 'full_bytes') return expired end
local network = ARGV[16]
if network ~= '' then
  -- the owner's voices retired are its own: without a token, and of its network
  if redis.call('ZCARD', prefix .. 'anonymous') - freed_voices + 1 > tonumber(ARGV[17]) then
    table.insert(expired, 1, 'full_anonymous') return expired
  end
  if redis.call('ZCARD', prefix .. 'network:' .. network) - freed_voices + 1 > tonumber(ARGV[18]) then
    table.insert(expired, 1, 'full_network') return expired
  end
end
for _, old in ipairs(retire) do
  drop(prefix, old)
  table.insert(expired, old)
end
redis.call('INCRBY', KEYS[3], size)
redis.call('HSET', KEYS[4], 'audio', ARGV[8], 'transcript', ARGV[9], 'mode', ARGV[10], 'owner', ARGV[2],
           'created', ARGV[3], 'size', ARGV[4], 'name', ARGV[12], 'anonymous', ARGV[13], 'expires', ARGV[14],
           'network', network, 'public', ARGV[19], 'name_key', ARGV[20])
if ARGV[19] == '1' then redis.call('HSET', prefix .. 'public', ARGV[20], ARGV[1]) end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
if ARGV[14] ~= '' then redis.call('ZADD', prefix .. 'expiry', ARGV[14], ARGV[1]) end
if network ~= '' then
  redis.call('ZADD', prefix .. 'anonymous', ARGV[3], ARGV[1])
  redis.call('ZADD', prefix .. 'network:' .. network, ARGV[3], ARGV[1])
end
table.insert(expired, 1, 'ok')
return expired
"""

# Delete one voice if `owner` owns it (ARGV[2] empty: any owner) and it has not expired (that is
# for the purge). KEYS: the voice. ARGV: id, owner, the key prefix, now.
_DELETE = _DROP + """
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then return 0 end
if ARGV[2] ~= '' and owner ~= ARGV[2] then return 0 end
local expires = redis.call('HGET', KEYS[1], 'expires')
if expires and expires ~= '' and tonumber(expires) <= tonumber(ARGV[4]) then return 0 end
drop(ARGV[3], ARGV[1])
return 1
"""

# Make one voice public ('1') or private ('0') if `owner` owns it (ARGV[2] empty: any owner) and
# it has not expired; a public one needs a name no other live public voice has. KEYS: the voice.
# ARGV: id, owner, the key prefix, now, public. Returns 'none', 'nameless', 'name_taken' or 'ok'.
_SET_PUBLIC = _LIVE + """
local fields = redis.call('HMGET', KEYS[1], 'owner', 'expires', 'name', 'name_key')
local owner, expires, name = fields[1], fields[2], fields[4] or fields[3]
if not owner then return 'none' end
if ARGV[2] ~= '' and owner ~= ARGV[2] then return 'none' end
if expires and expires ~= '' and tonumber(expires) <= tonumber(ARGV[4]) then return 'none' end
local index = ARGV[3] .. 'public'
if ARGV[5] == '1' then
  if not name or name == '' then return 'nameless' end
  local holder = redis.call('HGET', index, name)
  if holder and holder ~= ARGV[1] and live(ARGV[3], holder, ARGV[4]) then
    return 'name_taken'
  end
  redis.call('HSET', index, name, ARGV[1])
elseif name and name ~= '' and redis.call('HGET', index, name) == ARGV[1] then
  redis.call('HDEL', index, name)
end
redis.call('HSET', KEYS[1], 'public', ARGV[5])
return 'ok'
"""


# Move one public name's entry to its normal form. KEYS: the `public` hash, the voice. ARGV: the
# name as indexed, its normal form, the voice's id. A name the normal form holds already (two
# public voices an earlier version let read the same) stays with the one there.
_KEY_PUBLIC_NAME = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[3] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
redis.call('HSETNX', KEYS[1], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[2], 'name_key', ARGV[2])
return 1
"""


class RedisStore(VoiceStore):
    """A Redis server (`redis://HOST:PORT/DB`) shared by every replica. Keys under `voxws:`."""

    name = "redis"
    shared = True
    PREFIX = "voxws:"
    TIMEOUT_S = 2.0

    def __init__(self, url: str, limits: StoreLimits, clock: Callable[[], float] = time.time) -> None:
        super().__init__(limits, clock)
        import redis.asyncio as redis

        self.url = url
        self._redis = redis.from_url(url, socket_timeout=self.TIMEOUT_S,
                                     socket_connect_timeout=self.TIMEOUT_S)
        self._put_script = self._redis.register_script(_PUT)
        self._delete_script = self._redis.register_script(_DELETE)
        self._expire_script = self._redis.register_script(_EXPIRE)
        self._set_public_script = self._redis.register_script(_SET_PUBLIC)
        self._key_public_script = self._redis.register_script(_KEY_PUBLIC_NAME)
        self.public: RedisPublic = RedisPublic(self)

    async def open(self) -> None:
        await super().open()
        await _key_public_names(self)

    def describe(self) -> str:
        return "redis:" + self.url.split("@")[-1]          # no password in what is shown

    async def _call(self, what: str, work: Any) -> Any:
        import redis

        try:
            return await work
        except (redis.RedisError, OSError) as exc:
            # Unreachable, or refusing: READONLY after a fail-over, OOM at maxmemory, a script
            # killed... whatever the cause, the store cannot serve now; the caller may retry.
            raise StoreUnavailable(what, exc) from None

    def _key(self, kind: str, name: str = "") -> str:
        return f"{self.PREFIX}{kind}{':' + name if name else ''}"

    async def get(self, voice: str) -> StoredVoice | None:
        fields = await self._call("get", self._redis.hgetall(self._key("voice", voice)))
        if not fields:
            return None
        text = {k.decode(): v for k, v in fields.items()}
        transcript = text["transcript"].decode()
        name = text.get("name", b"").decode()
        expires = text.get("expires", b"").decode()
        network = text.get("network", b"").decode()
        stored = StoredVoice(id=voice, audio=text["audio"], transcript=transcript or None,
                             mode=text["mode"].decode(), owner=text["owner"].decode(),
                             created=float(text["created"]), name=name or None,
                             anonymous=text.get("anonymous") == b"1",
                             expires=float(expires) if expires else None,
                             network=network or None, public=text.get("public") == b"1")
        return None if stored.expired(self.clock()) else stored

    async def _read_secret(self) -> bytes:
        """Made by the first replica to ask (SET NX), read by every one after."""
        key = self._key("secret")
        await self._call("secret", self._redis.set(key, secrets.token_bytes(SECRET_BYTES), nx=True))
        kept = await self._call("secret", self._redis.get(key))
        if kept is None or len(kept) != SECRET_BYTES:
            raise StoreUnavailable(f"its key {key} does not hold a secret of {SECRET_BYTES} bytes")
        return kept

    async def usable(self, voice: str, owner: str) -> bool:
        stored, name, expires, public = await self._call("get", self._redis.hmget(
            self._key("voice", voice), "owner", "name", "expires", "public"))
        return stored is not None and not (expires and float(expires) <= self.clock()) and \
            may_speak_with(stored.decode(), (name or b"").decode() or None, owner, public == b"1")

    async def has(self, voice: str) -> bool:
        expires = await self._call("has", self._redis.hmget(self._key("voice", voice), "owner", "expires"))
        return expires[0] is not None and not (expires[1] and float(expires[1]) <= self.clock())

    async def _owned(self, owner: str) -> int:
        return len(await self._summaries(self._key("owner", owner)))

    async def owned_by(self, owner: str) -> list[VoiceSummary]:
        return await self._summaries(self._key("owner", owner_key(owner)))

    async def _anonymous(self, network: str) -> tuple[int, int]:
        # Expired voices still counted until the next purge: a forecast, which `put` decides.
        pipe = self._redis.pipeline(transaction=False)
        pipe.zcard(self._key("anonymous"))
        pipe.zcard(self._key("network", network))
        anonymous, in_network = await self._call("usage", pipe.execute())
        return int(anonymous), int(in_network)

    async def every_voice(self) -> list[VoiceSummary]:
        return await self._summaries(self._key("voices"))

    async def _summaries(self, index: str) -> list[VoiceSummary]:
        """The voices a zset of ids lists, oldest first, not expired."""
        ids = await self._call("list", self._redis.zrange(index, 0, -1))
        return await self._described([voice.decode() for voice in ids])

    async def _described(self, ids: list[str]) -> list[VoiceSummary]:
        """The voices of these ids, in their order, that are there and not expired."""
        pipe = self._redis.pipeline(transaction=False)
        for voice in ids:
            pipe.hmget(self._key("voice", voice), "mode", "transcript", "size", "created", "name", "owner",
                       "expires", "public")
        rows = await self._call("list", pipe.execute()) if ids else []
        now = self.clock()
        return [VoiceSummary(voice, mode.decode(), transcript.decode() or None, int(size), float(created),
                             (name or b"").decode() or None, owner.decode(),
                             float(expires) if expires else None, public == b"1")
                for voice, (mode, transcript, size, created, name, owner, expires, public) in zip(ids, rows)
                if mode is not None                  # deleted between the two reads
                and not (expires and float(expires) <= now)]

    async def expire(self) -> list[str]:
        gone = await self._call("expire", self._expire_script(keys=[],
                                                              args=[self.PREFIX, repr(self.clock())]))
        return [voice.decode() for voice in gone]

    async def put(self, voice: StoredVoice) -> list[str]:
        limits = self.limits
        keys = [self._key("voices"), self._key("owner", voice.owner), self._key("bytes"),
                self._key("voice", voice.id)]
        args = [voice.id, voice.owner, repr(voice.created), len(voice.audio), limits.cap_of(voice.anonymous),
                limits.max_voices, limits.max_bytes, voice.audio, voice.transcript or "", voice.mode,
                self.PREFIX, voice.name or "", "1" if voice.anonymous else "0",
                repr(voice.expires) if voice.expires is not None else "", repr(self.clock()),
                voice.network or "", limits.anonymous, limits.per_network, "1" if voice.public else "0",
                name_key(voice.name) if voice.name else ""]
        answer = await self._call("put", self._put_script(keys=keys, args=args))
        status = answer[0].decode() if isinstance(answer[0], bytes) else answer[0]
        if status in ("exists", "ok"):
            return [old.decode() for old in answer[1:]]
        if status == "nameless":
            raise nameless_public()
        if status == "name_taken":
            raise public_name_taken(voice.name or "")
        if status == "full_voices":
            raise Refused(ErrorKind.BUSY,
                          f"the voice store holds {limits.max_voices} voices: delete some first")
        if status == "full_bytes":
            raise Refused(ErrorKind.BUSY,
                          f"the voice store holds {limits.max_bytes} bytes of audio: delete some first")
        if status == "full_anonymous":
            self.limits.refuse_share(limits.anonymous, 0)
        if status == "full_network":
            self.limits.refuse_share(0, limits.per_network)
        raise AssertionError(f"the put script answered {status!r}")

    async def delete(self, voice: str, owner: str) -> bool:
        keys = [self._key("voice", voice)]
        who = "" if owner == ANY_OWNER else owner_key(owner)
        args = [voice, who, self.PREFIX, repr(self.clock())]
        return bool(await self._call("delete", self._delete_script(keys=keys, args=args)))

    async def usage(self) -> dict[str, int]:
        voices = await self._call("usage", self._redis.zcard(self._key("voices")))
        size = await self._call("usage", self._redis.get(self._key("bytes")))
        return {"voices": int(voices), "bytes": int(size or 0)}

    async def close(self) -> None:
        await self._redis.aclose()


async def _key_public_names(store: RedisStore) -> None:
    """Public names an earlier version indexed as given move to their normal form (`name_key`),
    which names are compared by now; by any replica, any number of times."""
    index = store._key("public")
    for field, voice in (await store._call("open", store._redis.hgetall(index))).items():
        name = field.decode()
        if name_key(name) != name:
            await store._call("open", store._key_public_script(
                keys=[index, store._key("voice", voice.decode())], args=[name, name_key(name), voice]))


class RedisPublic(PublicVoices):
    """The public voices of a Redis store: its `public` hash (name -> id), kept with the voices
    by its scripts, atomically."""

    def __init__(self, store: RedisStore) -> None:
        super().__init__(store)
        self._kept = store

    async def id(self, name: str) -> str | None:
        store = self._kept
        public = await store._call("get", store._redis.hget(store._key("public"), name_key(name)))
        return public.decode() if public is not None and await store.has(public.decode()) else None

    async def listed(self) -> list[VoiceSummary]:
        store = self._kept
        ids = await store._call("list", store._redis.hvals(store._key("public")))
        return sorted(await store._described([voice.decode() for voice in ids]), key=lambda v: v.created)

    async def set(self, voice: str, owner: str, public: bool) -> VoiceSummary | None:
        store = self._kept
        who = "" if owner == ANY_OWNER else owner_key(owner)
        args = [voice, who, store.PREFIX, repr(store.clock()), "1" if public else "0"]
        answer = await store._call("set_public", store._set_public_script(keys=[store._key("voice", voice)],
                                                                           args=args))
        status = answer.decode() if isinstance(answer, bytes) else answer
        if status == "none":
            return None
        if status == "nameless":
            raise nameless_public()
        stored = await store.get(voice)
        if stored is None:
            raise StoreUnavailable("set_public: the voice went meanwhile")
        if status == "name_taken":
            raise public_name_taken(stored.name or "")
        return stored.summary()
