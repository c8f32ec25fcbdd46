"""Every Redis key the gateway uses, under one configurable prefix (``redis.prefix``, default ``warmroute:``).

Layout (``P`` is the prefix; times are milliseconds on the *Redis server's* clock, so replicas' clocks may
disagree without harm):

``P pin:<conversation>``      string, the backend id the conversation is pinned to; ``PX`` = affinity TTL.
                              Written only by scripts that keep it and the set below consistent.
``P convs:<backend>``         sorted set of conversations pinned to the backend, scored by their expiry.
                              Pinned count = ZCARD after trimming scores <= now (done on every read), so
                              counts follow expiring pins and never drift.
``P replicas``                sorted set of live replicas (one per worker process), scored by lease expiry.
``P inflight:<replica>``      hash: backend id -> that replica's requests in flight, plus ``_seq`` (the
                              replica's publication counter; an older snapshot never overwrites a newer
                              one). ``PEXPIRE`` = lease TTL; the replica republishes on every round trip
                              and at least every ``heartbeat_s``, so a crashed replica's counts vanish.
``P admin:backends``          hash: backend id -> JSON of its runtime record (admin API):
                              ``{"config": {...}}`` for a backend added or changed at runtime, ``{"config":
                              null}`` for one
                              removed, plus ``"drained"``/``"cordoned"`` operator flags. No TTL.
``P admin:version``           integer, INCR'd with every write to the hash above (same MULTI); replicas
                              poll it and re-read the hash when it moved (gateway/admin/sync.py).
``P resp:<response id>``      string, the backend id holding that /v1/responses id's state (its engine
                              process's store); ``PX`` = ``routing.response_owner_ttl_s``. Written before
                              the id reaches the client (gateway/ownership.py).
``P quota:<name>``            hash: a client key's quota window: ``r`` requests admitted, ``t`` tokens;
                              ``PEXPIRE`` = ``quotas.window_s``, set when the window opens (its first
                              request, or a charge after it closed): the key's expiry is the window's end.
``P quota-flight:<name>``     hash: replica id -> ``count:seq``, the key's requests in flight there as that
                              replica counts them (written over, only by a newer seq). Counted only for
                              replicas in ``P replicas`` with a live lease, so a crashed replica's vanish.
``P epoch``                   random token set by the first replica to find it missing. A change means
                              Redis lost its data (restart without persistence, FLUSHALL): replicas then
                              write their local pins back.

Scripts build the ``convs:`` and ``inflight:`` names from the prefixes below, so every key lives under one
prefix. With Redis Cluster, choose a hash-tagged prefix (``{warmroute}:``) so all keys share one slot.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RedisKeys:
    prefix: str = "warmroute:"

    def pin(self, conversation: str) -> str:
        return f"{self.prefix}pin:{conversation}"

    def response_owner(self, response_id: str) -> str:
        return f"{self.prefix}resp:{response_id}"

    @property
    def conversations_prefix(self) -> str:
        return f"{self.prefix}convs:"

    def conversations(self, backend: str) -> str:
        return self.conversations_prefix + backend

    @property
    def replicas(self) -> str:
        return f"{self.prefix}replicas"

    @property
    def in_flight_prefix(self) -> str:
        return f"{self.prefix}inflight:"

    def in_flight(self, replica: str) -> str:
        return self.in_flight_prefix + replica

    @property
    def epoch(self) -> str:
        return f"{self.prefix}epoch"

    @property
    def admin_backends(self) -> str:
        return f"{self.prefix}admin:backends"

    @property
    def admin_version(self) -> str:
        return f"{self.prefix}admin:version"

    def quota(self, client: str) -> str:
        return f"{self.prefix}quota:{client}"

    def quota_in_flight(self, client: str) -> str:
        return f"{self.prefix}quota-flight:{client}"
