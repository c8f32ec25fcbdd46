"""TTFT (routing v2): place every request where its expected time to first token is lowest.

Costs come from ``routing.cost`` (queue ahead + uncached prompt / prefill rate + active load).

- retry after a failure                 -> cheapest of the rest        (retry_next; the pin follows a failed
                                                                        pinned backend)
- pinned (or the twin hint) routable     -> stay unless this turn's own time (queue + prefill, no load
                                           term; elsewhere plus the re-prefill its arrival causes where the
                                           KV cache is full) is lower elsewhere by the margin
                                           (affinity_hit: touch the pin, or claim the hint)
  - home no busier than there in the long run (load term less the requests in flight, which the
    queue term counts): its queue drains and it keeps the history:
    a one-off spill, the pin stays, if it still wins after paying the re-read of this turn's tail at
    home on the next turn (the spilled turn is not cached there) and its prefill there once more (the
    wait it adds to whatever arrives there next)                        (spill_overload)
    (unless its KV cache events say it evicted the history: then the pin moves, and without the margin)
  - home busier for good: move the pin; the move pays one re-prefill, now, in the cost it won with, and
    what it reads there beyond home once more (the wait it adds there); spilling every turn would pay it
    every turn
                                                                         (move_cheaper)
- pinned backend down/draining/removed  -> cheapest, re-pin            (repin_unhealthy / repin_removed)
- new                                   -> cheapest (load term included), claim        (new_cheapest)
  - several within ``_SPREAD_SHARE`` (5 %) of the cheapest: the one given a new conversation least
    recently (``Candidate.placed_at``), so conversations that start close together (agents starting in
    a burst, before any queue tells their engines apart) are spread across engines in turn instead of
    by each key's hash: sessions that start together, kept on one engine, tend to keep arriving together.

Other ties go by the rendezvous tie-break, so every replica given the same snapshot decides the same.
"""

from __future__ import annotations

from routing.cost import (
    cost,
    in_flight_load_s,
    lost_history,
    overflow_tokens,
    rate,
    total_s,
    uncached_tokens,
)
from routing.load import find, key_seed, rendezvous
from routing.params import RoutingParams
from routing.types import (
    NO_BACKEND,
    Candidate,
    Candidates,
    Cost,
    Decision,
    PinAction,
    Reason,
    RouteRequest,
)

# The members the common decisions (a hit, a new conversation) return, as module constants: on Python 3.11
# each class attribute load of an Enum member goes through ``EnumType``'s slow getattr hook (~0.25 us).
_HIT, _NEW, _TOUCH, _CLAIM = Reason.AFFINITY_HIT, Reason.NEW_CHEAPEST, PinAction.TOUCH, PinAction.CLAIM

_MIN_MARGIN_S = 0.02
#: New conversations: backends whose expected TTFT is within this share of the cheapest's (and 20 ms)
#: count as equal: estimates of that size are not worth telling apart (a prompt's tokens are guessed from
#: its characters, a queue's from the estimates of the requests in it).
_SPREAD_SHARE = 0.05


class TtftPolicy:
    uses_affinity = True

    def __init__(self, cfg: RoutingParams) -> None:
        self.load_share = cfg.load_share
        self.stay_margin = cfg.stay_margin

    def select(self, candidates: Candidates, request: RouteRequest, now: float) -> Decision:
        ready = [c for c in candidates if c.routable and c.id not in request.exclude]
        if not ready:
            return NO_BACKEND
        if request.exclude:
            best = self._cheapest(ready, request)
            failed = request.pinned in request.exclude or request.hint in request.exclude
            return self._decide(
                best, Reason.RETRY_NEXT, PinAction.MOVE if failed else PinAction.NONE, ready, request
            )
        home_id = request.pinned if request.pinned is not None else request.hint
        home = find(ready, home_id)  # nothing is excluded here: a home among the ready ones is routable
        if home is not None:
            return self._from_home(home, ready, request)
        if home_id is None:
            best = self._new_home(ready, request)
            return self._decide(best, _NEW, _CLAIM, ready, request)
        best = self._cheapest(ready, request)
        reason = Reason.REPIN_REMOVED if find(candidates, home_id) is None else Reason.REPIN_UNHEALTHY
        return self._decide(best, reason, _placed(request), ready, request)

    def costs(self, candidates: Candidates, request: RouteRequest) -> tuple[Cost, ...]:
        """Every routable candidate's cost, cheapest first (the order ``select`` ranks them in, but for a
        new conversation, which may go to a near-cheapest one: ``_new_home``)."""
        seed = key_seed(request.key)
        ready = [c for c in candidates if c.routable and c.id not in request.exclude]
        ranked = sorted(ready, key=lambda c: (total_s(c, request, self.load_share), rendezvous(seed, c.id)))
        return tuple(cost(c, request, self.load_share) for c in ranked)

    # -- internals ------------------------------------------------------------------------------------

    def _from_home(self, home: Candidate, ready: list[Candidate], request: RouteRequest) -> Decision:
        others = [c for c in ready if c.id != home.id]
        keep = _TOUCH if request.pinned is not None else _CLAIM
        if not others:
            return self._decide(home, _HIT, keep, ready, request)
        if home.conversations:
            # This conversation is one of its home's active ones: elsewhere it would not be. Compared
            # without it, a conversation does not leave just because it is there.
            home = home._replace(conversations=home.conversations - 1)
        best = self._cheapest(others, request)
        # Leaving is decided on this turn's own time (queue ahead + prefill), not on the load term: a
        # conversation is not re-prefilled elsewhere to even out load, only when waiting at home costs more.
        stay, there = cost(home, request, self.load_share), cost(best, request, self.load_share)
        stay_now, there_now = stay.queue_s + stay.prefill_s, there.queue_s + there.prefill_s
        # Arriving where the cache is full evicts as much (this conversation's or another's): a re-prefill
        # the move causes, so it is paid in the move's cost. Home already holds this conversation's share.
        there_now += overflow_tokens(best, request) / rate(best)
        # A home whose KV events say it evicted the history has nothing left to stay for: no hysteresis.
        # (Judging such a home on the whole cost, load term included, moved more follow-ups onto engines
        # that then evicted them: measured worse on the pressure bench.)
        lost = lost_history(home, request)
        margin = _MIN_MARGIN_S if lost else max(_MIN_MARGIN_S, self.stay_margin * stay_now)
        if there_now + margin >= stay_now:
            return self._decide(home, _HIT, keep, ready, request)
        # The long run is the load term less the requests in flight: those wait in the queue term already,
        # and a queue keeps requests in flight longer (in flight = arrivals x time there), so a passing
        # queue counted twice made home look busier for good. (With it, twins moved to a head holder for
        # a queue that then drained: identical-2x16-long, one move in about half the rounds, where home had
        # four requests in flight and two conversations between turns, the holder two and two.)
        standing_home = stay.load_s - in_flight_load_s(home, request, self.load_share)
        if standing_home <= there.load_s - in_flight_load_s(best, request, self.load_share) and not lost:
            # Home is no busier in the long run: its queue drains, and it still holds the history. A spill
            # leaves this turn out of home's cache, so the next turn there reads this tail again: the
            # spill pays it too. (Without it, twins spilled to a head holder for the few hundred tokens
            # of their reply and came back cold: one-off spills the oracle never makes.) And it pays its
            # prefill there twice: once in its own wait, once in the wait of whatever arrives there next
            # (work that engine would not have had: home does this tail anyway, on the next turn). Without
            # it, a follow-up among equally loaded identical engines spilled when home's queue was briefly
            # four turns long, and came back cold on the turn after.
            spill = there_now + there.prefill_s + request.tail_tokens / rate(home)
            if spill + margin >= stay_now:
                return self._decide(home, Reason.AFFINITY_HIT, keep, ready, request)
            return self._decide(best, Reason.SPILL_OVERLOAD, PinAction.NONE, ready, request)
        # Busier for good: move once (the re-prefill is in the cost it won with) rather than spill every turn.
        # A move pays the prefill it adds twice, as a spill does: once in its own wait, once in the wait it
        # adds there for whatever arrives next: what it reads there beyond what it would read at home (a home
        # that evicted the history adds nothing). (Without it, among equally loaded identical engines a
        # follow-up moved when its home briefly had two or three follow-ups queued: its group's head then
        # lived on two engines.)
        added = there.uncached_tokens - stay.uncached_tokens
        if added > 0 and there_now + added / rate(best) + margin >= stay_now:
            return self._decide(home, _HIT, keep, ready, request)
        return self._decide(best, Reason.MOVE_CHEAPER, _placed(request), ready, request)

    def _cheapest(self, ready: list[Candidate], request: RouteRequest) -> Candidate:
        best = ready[0]
        if len(ready) == 1:  # nothing to compare (one engine per model is common): no cost, no hash
            return best
        seed = key_seed(request.key)
        best_rank = (total_s(best, request, self.load_share), rendezvous(seed, best.id))
        for c in ready[1:]:
            rank = (total_s(c, request, self.load_share), rendezvous(seed, c.id))
            if rank < best_rank:
                best, best_rank = c, rank
        return best

    def _new_home(self, ready: list[Candidate], request: RouteRequest) -> Candidate:
        """Among the backends within ``_SPREAD_SHARE`` of the cheapest (and ``_MIN_MARGIN_S``), the one
        given a new conversation least recently; then the cheaper, then the rendezvous tie-break."""
        if len(ready) == 1:
            return ready[0]
        seed = key_seed(request.key)
        totals = [total_s(c, request, self.load_share) for c in ready]
        cheapest = min(totals)
        limit = cheapest + max(_MIN_MARGIN_S, _SPREAD_SHARE * cheapest)
        near = [(c.placed_at, t, rendezvous(seed, c.id), c) for c, t in zip(ready, totals, strict=True)
                if t <= limit]  # fmt: skip
        return min(near, key=lambda n: n[:3])[3]

    def _decide(
        self, chosen: Candidate, reason: Reason, pin: PinAction, ready: list[Candidate], request: RouteRequest
    ) -> Decision:
        uncached = uncached_tokens(chosen, request)
        costs = self.costs(ready, request) if request.explain else ()
        return Decision(chosen.id, reason, pin, uncached, costs)


def _placed(request: RouteRequest) -> PinAction:
    """A pin that exists is moved; a twin hint was never stored, so it is claimed."""
    return PinAction.MOVE if request.pinned is not None else PinAction.CLAIM
