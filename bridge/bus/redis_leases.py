"""The event scheduler's partition leases kept in Redis, beside the streams they divide
(:meth:`bridge.bus.redis_streams.RedisStreamsBus.leases`).

The same rules as the database store (``event_scheduler.leases.PartitionLeases``: heartbeat, fair
share ``ceil(partitions / live members)``, renew, give back the excess, take free or expired
partitions), but a round is one Lua script, atomic on the server and timed by the server's clock, so
every process compares the same clock. Why here and not in the database: an idle scheduler's round
then costs its database nothing; the event path's only idle statement is the relay's fallback probe.

Layout (:class:`bridge.bus.keys.BusKeys`): ``scheduler_members`` is a sorted set of holders scored by
their last heartbeat in ms; ``scheduler_leases`` a hash ``partition -> "<expires_ms> <holder>"``.
Losing them (a Redis restart without persistence) frees every partition: each scheduler takes its
share again on its next round, as after a takeover, and catches up from the database.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from bridge.bus.base import BusLeases, LeaseSnapshot
from bridge.bus.keys import BusKeys

#: One round. KEYS: members, leases. ARGV: holder, ttl in ms, partitions. Returns the partitions held
#: after the round, in order.
ROUND_LUA = """
local members, leases = KEYS[1], KEYS[2]
local me, ttl, parts = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', members, now, me)
redis.call('ZREMRANGEBYSCORE', members, '-inf', '(' .. (now - ttl))
local share = math.ceil(parts / math.max(redis.call('ZCARD', members), 1))
local mine, free = {}, {}
for p = 0, parts - 1 do
  local v = redis.call('HGET', leases, p)
  if v then
    local sp = string.find(v, ' ', 1, true)
    local expires, holder = tonumber(string.sub(v, 1, sp - 1)), string.sub(v, sp + 1)
    if holder == me then
      table.insert(mine, p)
    elseif expires < now then
      table.insert(free, p)
    end
  else
    table.insert(free, p)
  end
end
local held = {}
for i, p in ipairs(mine) do
  if i <= share then
    table.insert(held, p)
  else
    redis.call('HDEL', leases, p)
  end
end
for _, p in ipairs(free) do
  if #held >= share then break end
  table.insert(held, p)
end
table.sort(held)
local value = (now + ttl) .. ' ' .. me
for _, p in ipairs(held) do
  redis.call('HSET', leases, p, value)
end
return held
"""

#: Give everything back. KEYS: members, leases. ARGV: holder, partitions.
RELEASE_LUA = """
local me = ARGV[1]
for p = 0, tonumber(ARGV[2]) - 1 do
  local v = redis.call('HGET', KEYS[2], p)
  if v and string.sub(v, string.find(v, ' ', 1, true) + 1) == me then
    redis.call('HDEL', KEYS[2], p)
  end
end
redis.call('ZREM', KEYS[1], me)
return 0
"""


#: What status and preflight read. KEYS: members, leases. Returns the server's TIME (seconds, microseconds),
#: the members with their scores and the leases hash, all flat.
SNAPSHOT_LUA = """
local t = redis.call('TIME')
return {t[1], t[2], redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES'), redis.call('HGETALL', KEYS[2])}
"""


class RedisLeases(BusLeases):
    """:class:`bridge.bus.base.BusLeases` on Redis: one script per round or release."""

    def __init__(self, client: Any, keys: BusKeys, partitions: int) -> None:
        """``client`` is a server's or a cluster's (every key here shares one hash tag: one node runs each script)."""
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        self.client = client
        self.keys = keys
        self.partitions = partitions
        self._round = client.register_script(ROUND_LUA)
        self._release = client.register_script(RELEASE_LUA)
        self._snapshot = client.register_script(SNAPSHOT_LUA)

    def __repr__(self) -> str:
        return f"RedisLeases(namespace={self.keys.namespace!r}, partitions={self.partitions})"

    def _keys(self) -> list[str]:
        return [self.keys.scheduler_members, self.keys.scheduler_leases]

    def round(self, holder: str, ttl: float) -> set[int]:
        held = self._round(keys=self._keys(), args=[holder, max(1, int(ttl * 1000)), self.partitions])
        return {int(p) for p in held}

    def release(self, holder: str) -> None:
        self._release(keys=self._keys(), args=[holder, self.partitions])

    def snapshot(self) -> LeaseSnapshot:
        # A script, not a MULTI with TIME: one atomic read on the node holding the keys, by its clock, which a
        # cluster client allows (it refuses TIME in a pipeline: TIME names no key, so no node).
        secs, micros, members, leases = self._snapshot(keys=self._keys())
        leased: dict[int, tuple[str | None, datetime | None]] = {}
        for field, value in zip(leases[::2], leases[1::2], strict=True):
            expires, holder = _text(value).split(" ", 1)
            leased[int(_text(field))] = (holder, _at(float(expires)))
        return LeaseSnapshot(now=_at(int(secs) * 1000 + int(micros) / 1000),
                             members={_text(m): _at(float(_text(score)))
                                      for m, score in zip(members[::2], members[1::2], strict=True)},
                             leases=leased)


def _at(ms: float) -> datetime:
    return datetime.fromtimestamp(ms / 1000.0, UTC)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
