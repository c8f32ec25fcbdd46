"""Lua scripts of the Redis affinity store: each store operation is one script, so one round trip.

Calling convention of VIEW, COMMIT and HEARTBEAT (they share a prelude that publishes this replica's
in-flight counts, so ``started``/``finished`` never cost a round trip of their own):

    KEYS[1] replicas zset           ARGV[1] replica id     ARGV[2] lease TTL (ms)    ARGV[3] publication seq
    KEYS[2] this replica's hash     ARGV[4] n backends     ARGV[5 .. 4+n] backend ids
                                    ARGV[5+n .. 4+2n] this replica's in-flight counts, same order

Script-specific arguments follow at ``A = 5 + 2n``. Times come from ``TIME`` on the server.
"""

from __future__ import annotations

_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = tonumber(ARGV[4])
local lease = tonumber(ARGV[2])
local seq = tonumber(ARGV[3])
if seq > tonumber(redis.call('HGET', KEYS[2], '_seq') or '-1') then
  local fields = {'_seq', ARGV[3]}
  for i = 1, n do
    fields[#fields + 1] = ARGV[4 + i]
    fields[#fields + 1] = ARGV[4 + n + i]
  end
  redis.call('HSET', KEYS[2], unpack(fields))
end
redis.call('PEXPIRE', KEYS[2], lease)
redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
local A = 5 + 2 * n
"""

#: KEYS[3] pin key (when ARGV[A+2] == '1'); ARGV[A] in-flight key prefix, ARGV[A+1] conversations prefix.
#: Returns {pinned backend or nil, {pinned count per backend}, {in flight per backend, other replicas}}.
VIEW = (
    _PRELUDE
    + """
local pin = false
if ARGV[A + 2] == '1' then pin = redis.call('GET', KEYS[3]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local inflight, convs = {}, {}
for i = 1, n do inflight[i] = 0 end
if n > 0 then
  for _, r in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    if r ~= ARGV[1] then
      local vals = redis.call('HMGET', ARGV[A] .. r, unpack(ARGV, 5, 4 + n))
      for i = 1, n do inflight[i] = inflight[i] + (tonumber(vals[i]) or 0) end
    end
  end
end
for i = 1, n do
  local z = ARGV[A + 1] .. ARGV[4 + i]
  redis.call('ZREMRANGEBYSCORE', z, '-inf', now)
  convs[i] = redis.call('ZCARD', z)
end
return {pin, convs, inflight}
"""
)

#: KEYS[3] pin key; ARGV[A] 'claim' | 'touch' | 'move', ARGV[A+1] backend, ARGV[A+2] conversation,
#: ARGV[A+3] affinity TTL (ms), ARGV[A+4] conversations prefix. Returns the backend the pin now names.
#: claim/touch keep an existing pin (the first claim wins: SET NX semantics) and set a missing one;
#: move overwrites. The pin and the per-backend sets change together, atomically.
COMMIT = (
    _PRELUDE
    + """
local b, member, ttl, cp = ARGV[A + 1], ARGV[A + 2], tonumber(ARGV[A + 3]), ARGV[A + 4]
local cur = redis.call('GET', KEYS[3])
if cur and ARGV[A] ~= 'move' then
  b = cur
elseif cur and cur ~= b then
  redis.call('ZREM', cp .. cur, member)
end
redis.call('SET', KEYS[3], b, 'PX', ttl)
redis.call('ZADD', cp .. b, now + ttl, member)
return b
"""
)

#: KEYS[3] epoch key; ARGV[A] a fresh token, stored if the epoch is missing. Returns the current epoch.
HEARTBEAT = (
    _PRELUDE
    + """
local e = redis.call('GET', KEYS[3])
if not e then
  redis.call('SET', KEYS[3], ARGV[A])
  e = ARGV[A]
end
return e
"""
)

#: Write local pins back after an outage. KEYS[i] pin key of entry i; ARGV[1] conversations prefix;
#: entry i at ARGV[4i-2 ..]: conversation, backend, remaining TTL (ms), '1' to overwrite a different pin
#: (a move made during the outage is newer) or '0' (SET NX: a pin already in Redis wins). Returns #written.
RESTORE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cp = ARGV[1]
local written = 0
for i = 1, #KEYS do
  local member, b, ttl, force = ARGV[4 * i - 2], ARGV[4 * i - 1], tonumber(ARGV[4 * i]), ARGV[4 * i + 1]
  local cur = redis.call('GET', KEYS[i])
  if not cur or (force == '1' and cur ~= b) then
    if cur then redis.call('ZREM', cp .. cur, member) end
    redis.call('SET', KEYS[i], b, 'PX', ttl)
    redis.call('ZADD', cp .. b, now + ttl, member)
    written = written + 1
  end
end
return written
"""


#: Forget one pin (admin API). KEYS[1] pin key; ARGV[1] conversations prefix, ARGV[2] conversation.
#: Returns the backend it was pinned to, or false.
FORGET = """
local cur = redis.call('GET', KEYS[1])
if cur then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', ARGV[1] .. cur, ARGV[2])
end
return cur
"""


#: Quotas per client key (gateway/redis_quotas.py; the rules of gateway/quota_windows.py). Both scripts
#: publish this replica's own count of the key's requests in flight as ``count:seq`` in the in-flight hash,
#: written over (never incremented) and only by a newer ``seq``: a finish lost in an outage heals at the
#: next call, and calls that reach Redis out of order never leave an older count.
_QUOTA_PUBLISH = """
local function publish(h, replica, count, seq)
  local cur = redis.call('HGET', h, replica)
  if cur then
    local was = tonumber(string.match(cur, ':(%d+)$'))
    if was and was >= seq then return end
  end
  redis.call('HSET', h, replica, count .. ':' .. seq)
  redis.call('PEXPIRE', h, 86400000)
end
"""

#: KEYS[1] the key's window hash (fields r: requests, t: tokens; PEXPIRE = window, set when it opens),
#: KEYS[2] its in-flight hash (replica id -> count:seq), KEYS[3] replicas zset (lease expiry per replica).
#: ARGV[1] this replica, ARGV[2] window (ms), ARGV[3..5] requests / tokens / concurrent limits (0: none),
#: ARGV[6] '1' to count the request admitted (a read of the state: '0', which writes nothing), ARGV[7]
#: this replica's requests in flight for the key as it counts them, this one included when counting
#: (reserved before the call, so two admissions in flight from one replica never both take the last
#: place), ARGV[8] this replica's publication seq.
#: Returns {refused: 0 none, 1 requests, 2 tokens, 3 concurrent; requests; tokens; ms to reset; in flight}.
#: Fields of replicas whose lease ran out (they crashed) are dropped.
QUOTA_ADMIT = (
    _QUOTA_PUBLISH
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local win = tonumber(ARGV[2])
local rpm, tpm, conc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local counting = ARGV[6] == '1'
local mine = tonumber(ARGV[7])
if counting then mine = mine - 1 end
local r = tonumber(redis.call('HGET', KEYS[1], 'r') or '0')
local tk = tonumber(redis.call('HGET', KEYS[1], 't') or '0')
local ttl = redis.call('PTTL', KEYS[1])
local flying = mine
local held = redis.call('HGETALL', KEYS[2])
for i = 1, #held, 2 do
  local replica = held[i]
  if replica ~= ARGV[1] then
    local lease = redis.call('ZSCORE', KEYS[3], replica)
    if lease and tonumber(lease) > now then
      flying = flying + (tonumber(string.match(held[i + 1], '^(%d+)')) or 0)
    else
      redis.call('HDEL', KEYS[2], replica)
    end
  end
end
local refused = 0
if rpm > 0 and r >= rpm then refused = 1
elseif tpm > 0 and tk >= tpm then refused = 2
elseif conc > 0 and flying >= conc then refused = 3 end
if counting then
  if refused == 0 then
    r = redis.call('HINCRBY', KEYS[1], 'r', 1)
    if ttl < 0 then
      redis.call('PEXPIRE', KEYS[1], win)
      ttl = win
    end
    mine = mine + 1
    flying = flying + 1
  end
  publish(KEYS[2], ARGV[1], mine, tonumber(ARGV[8]))
end
if ttl < 0 then ttl = win end
return {refused, r, tk, ttl, flying}
"""
)

#: An admitted request ended. KEYS[1] window hash, KEYS[2] in-flight hash; ARGV[1] this replica,
#: ARGV[2] window (ms), ARGV[3] its tokens, charged to the window open now (one opens if none is),
#: ARGV[4] this replica's requests in flight for the key now, ARGV[5] its publication seq.
QUOTA_FINISH = (
    _QUOTA_PUBLISH
    + """
publish(KEYS[2], ARGV[1], tonumber(ARGV[4]), tonumber(ARGV[5]))
local tokens = tonumber(ARGV[3])
if tokens > 0 then
  local ttl = redis.call('PTTL', KEYS[1])
  redis.call('HINCRBY', KEYS[1], 't', tokens)
  if ttl < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
end
return 1
"""
)
