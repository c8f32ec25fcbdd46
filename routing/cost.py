"""Expected time to first token of one request on one candidate: the ttft policy's cost model.

    total = (queued + uncached + load) / rate

- ``rate``: the backend's prefill rate (learned by the gateway, ``routing.speed``; before that the weight
  times ``DEFAULT_PREFILL_TPS``).
- ``uncached``: prompt tokens it does not hold. An engine whose KV cache events say what it holds of this
  conversation (``request.kv_held``) is taken at its word, so a pin it evicted is cold and the engine
  that still holds the longest prefix is the cheapest to prefill on. Otherwise it is inferred: the pinned
  backend (or the one that produced this conversation's first reply) holds all but the tail appended
  since the last reply; a backend that recently prefilled the same head holds the head; any other holds
  nothing the gateway knows of. An inferred hold is scaled by the backend's ``retention`` (an engine under
  cache pressure keeps only part of what it was sent) and is never more than its KV cache holds
  (``kv_capacity``, when the engine reports it).
- ``queued``: prefill work ahead of it: this gateway's requests there that have not had a first byte, or the
  engine's own waiting queue (times a turn's tokens) when it reports one and that is larger.
- ``load``: the other conversations sharing it (``sharing``: where the engine reports its KV cache size, those
  still between turns, ``Candidate.competing``; else every active one, idle pins excluded) and requests in
  flight each bring about one turn's tokens soon; counting them spreads new conversations before the queue
  shows it. (Counting every active one where the competing ones are known put finished conversations, which
  linger among the active ones for the whole active window, into the load: on the pressure bench the
  large-cache engines, whose conversations finish sooner, were charged 6-8 conversations where 2-4 still
  ran, and new ones queued on the small caches: follow-up TTFT 1299 ms against 1253 ms counting only the
  competing ones, one round each; distinct and fleet 1.015x, within a round's noise.)
  (Retention is deliberately not in the load term: charging each active conversation of an evicting engine
  the history it lost sent new conversations to the large-cache engines until those queued: measured worse
  than without, see the routing notes.)
- ``pressure`` (in the load term, engines that report their KV cache size): how much of the conversations
  that compete for the cache there (each taken to be about this prompt and a turn long) does not fit: the
  recently active ones (``Candidate.competing``: a finished conversation lingers among the active ones for
  the whole active window), those in flight and this one. Every one of them re-prefills that overflow (at
  most its size) each round of turns: the cache evicts the least recently used blocks, and with turns in
  rotation the least recently used conversation is the next to come back. So an engine whose cache is
  full costs more than one with room, and conversations spread to where they stay cached instead of
  evicting each other. (Measured on the pressure bench against charging only the arriving conversation
  its ``overflow``: turn-1 p95 2.7 s against 3.2-3.7 s, follow-up TTFT the same. The whole overflow once,
  not once per conversation, was measured worse: a thrashed cache was still credited with its size, so
  new conversations kept off the small caches until the large ones queued.)

Pure arithmetic on plain values; no allocation unless a ``Cost`` is asked for.
"""

from __future__ import annotations

from routing.params import DEFAULT_PREFILL_TPS
from routing.types import Candidate, Cost, RouteRequest


def rate(c: Candidate) -> float:
    return c.prefill_tps if c.prefill_tps > 0 else DEFAULT_PREFILL_TPS * c.weight


def cached_tokens(c: Candidate, request: RouteRequest) -> int:
    if request.kv_held:
        for backend, held in request.kv_held:
            if backend == c.id:
                return min(max(0, held), request.prompt_tokens)
    if c.id == request.pinned or c.id == request.hint:
        held = max(0, request.prompt_tokens - request.tail_tokens)
    elif c.id in request.holders:
        held = min(request.head_tokens, request.prompt_tokens)
    else:
        return 0
    if 0 < c.kv_capacity < held:
        held = c.kv_capacity
    return int(held * c.retention) if c.retention < 1.0 else held  # (not a number: nothing learned, all held)


def lost_history(c: Candidate, request: RouteRequest) -> bool:
    """Its KV cache events say ``c`` no longer holds most of this conversation's history (it evicted it).

    Only the engine's word counts: treating a home as lost by inference (learned retention, cache size)
    moved 4 to 27 of 96 follow-ups off small caches on the pressure bench, onto large ones that then
    evicted, and was measured worse (1.27x affinity in one round, against 0.99x without)."""
    if request.kv_held:
        for backend, held in request.kv_held:
            if backend == c.id:
                return 2 * held < request.prompt_tokens - request.tail_tokens
    return False


def sharing(c: Candidate, request: RouteRequest) -> int:
    """Conversations sharing ``c``'s KV cache if this one is served there: those competing for it (recently
    active, else every active one), the requests in flight, and this one unless it is already counted (a
    home's competing ones include it; a home's ``conversations`` are passed without it by the policy)."""
    if c.competing < 0:
        return c.conversations + c.in_flight + 1
    home = c.competing > 0 and (c.id == request.pinned or c.id == request.hint)
    return c.competing + c.in_flight + (0 if home else 1)


def overflow_tokens(c: Candidate, request: RouteRequest) -> int:
    """What this conversation adds beyond ``c``'s KV cache: 0 when it has room for the conversations that
    share it (``sharing``; each taken to be about this prompt and a turn long), at most this conversation's
    size. Either this conversation or one it evicts is prefilled again on every round of turns there."""
    if c.kv_capacity <= 0:
        return 0
    size = request.prompt_tokens + request.turn_tokens
    over = sharing(c, request) * size - c.kv_capacity
    return 0 if over <= 0 else min(size, over)


def pressure_tokens(c: Candidate, request: RouteRequest) -> int:
    """The load term's cache pressure: what the conversations sharing ``c``'s KV cache (``sharing``, each
    taken to be about this prompt and a turn long) re-prefill on a round of their turns there. 0 when they
    fit; beyond, every one of them loses the overflow (at most its size), not just the last to arrive: the
    cache evicts the least recently used blocks, the least recently used conversation is the next to come
    back, so with turns in rotation each arrival re-prefills what the one before it evicted."""
    if c.kv_capacity <= 0:
        return 0
    size = request.prompt_tokens + request.turn_tokens
    n = sharing(c, request)
    over = n * size - c.kv_capacity
    return 0 if over <= 0 else n * (size if size < over else over)


def uncached_tokens(c: Candidate, request: RouteRequest) -> int:
    return request.prompt_tokens - cached_tokens(c, request)


def queued_tokens(c: Candidate, turn_tokens: int) -> int:
    reported = c.waiting * turn_tokens if c.waiting > 0 else 0
    return max(c.prefilling, reported)


def load_tokens(c: Candidate, request: RouteRequest) -> int:
    """The next turns of the other conversations sharing it (``sharing`` less this one: those still between
    turns where known, else every active one, and the requests in flight), and its cache pressure."""
    return (sharing(c, request) - 1) * request.turn_tokens + pressure_tokens(c, request)


def in_flight_load_s(c: Candidate, request: RouteRequest, load_share: float) -> float:
    """The part of ``c``'s load term (``Cost.load_s``) its requests in flight bring: a turn's tokens each.
    They wait in the queue term too, and a queue keeps requests in flight longer, so the policy takes this
    off the load term where it asks which engine is busier in the long run."""
    return c.in_flight * (request.turn_tokens * load_share) / rate(c)


def total_s(c: Candidate, request: RouteRequest, load_share: float) -> float:
    """``cost(...).total_s`` without building the ``Cost``: the hot path's, once per candidate per decision.

    The same arithmetic on the same values in the same order as ``cost`` (so the same float), written out
    in one function: its six helpers' calls were most of a ttft decision's CPU."""
    r = c.prefill_tps if c.prefill_tps > 0 else DEFAULT_PREFILL_TPS * c.weight
    turn = request.turn_tokens
    waiting = c.waiting * turn if c.waiting > 0 else 0
    queued = c.prefilling if c.prefilling >= waiting else waiting
    prompt = request.prompt_tokens
    n = sharing(c, request)
    load = (n - 1) * turn
    capacity = c.kv_capacity
    if capacity > 0:
        size = prompt + turn
        over = n * size - capacity
        if over > 0:
            load += n * (size if size < over else over)
    if request.kv_held or c.id == request.pinned or c.id == request.hint or c.id in request.holders:
        prompt -= cached_tokens(c, request)
    return queued / r + prompt / r + load * load_share / r


def cost(c: Candidate, request: RouteRequest, load_share: float) -> Cost:
    r = rate(c)
    uncached = uncached_tokens(c, request)
    queue_s = queued_tokens(c, request.turn_tokens) / r
    prefill_s = uncached / r
    load_s = load_tokens(c, request) * load_share / r
    return Cost(c.id, uncached, queue_s, prefill_s, load_s, queue_s + prefill_s + load_s)
