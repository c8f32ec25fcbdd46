"""Whose fault an engine's HTTP 5xx answer is, for its circuit breaker: the engine's, or the request's.

One client must not take engines away from every other client by sending bodies the engines answer with a
5xx (a poison pill). A failure without an answer (connect error, timeout, broken or garbled head, a break
mid-stream) counts against the engine as it is: a dead or wedged engine must still open its breaker at once.
A 5xx *answer* means the engine was up and talking, and the input may be what it choked on; the request's
other attempt (the one retry, on another engine) decides:

- a 5xx on the first attempt, and the retry on another engine got an answer (< 500): ``ENGINE``, a failure
  like any other (the input was fine);
- a 5xx on both attempts: ``REQUEST`` for both, counted for nobody (the input's own; one log line);
- a 5xx with no second opinion (no other engine admits the request, or its other attempt failed without an
  answer): ``UNCONFIRMED``, a failure counted per client.

An ``UNCONFIRMED`` failure counts toward ``breaker.failure_threshold``, but a streak made only of them opens
the breaker only once two distinct clients (``RequestContext.requester``) had one. So an engine that fails
everyone's requests still opens, and one client alone never opens it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol

log = logging.getLogger("warmroute.blame")


class Blame(StrEnum):
    """What an engine's 5xx answer says about the engine. Values are log fields: keep them stable."""

    ENGINE = "engine"  # another engine answered the same request: a failure like any other
    UNCONFIRMED = "unconfirmed"  # nobody else was asked: a failure, counted per client
    REQUEST = "request"  # another engine failed it with a 5xx too: the request's own, counted for nobody


def blame_5xx(other: int | None) -> Blame:
    """The blame for one attempt's 5xx, given the status the same request's other attempt got (None: there
    was none, or it failed without an answer)."""
    if other is None:
        return Blame.UNCONFIRMED
    return Blame.ENGINE if other < 500 else Blame.REQUEST


class OutcomeFeed(Protocol):
    """Where verdicts go: the backends' breakers (``backends.fleet.Fleet``, through the proxy's feed)."""

    def outcome(self, backend_id: str, ok: bool) -> None:
        """A success, or a failure only the engine explains (``ENGINE``)."""

    def answer_failed(self, backend_id: str, client: str) -> None:
        """A 5xx answer no other engine confirmed (``UNCONFIRMED``): counted per client."""

    def abstain(self, backend_id: str) -> None:
        """A 5xx that was the request's own (``REQUEST``): no outcome for the breaker."""


def settle(feed: OutcomeFeed, requester: str, attempts: Sequence[tuple[str, int | None]], what: str) -> None:
    """Feed the breakers the 5xx answers among one request's failed attempts: (backend id, status; None:
    it failed without an answer, which was recorded when it happened), at most two. A request that got a
    5xx from two engines is logged once (``what``: its method and path)."""
    statuses = [status for _, status in attempts]
    for i, (backend, status) in enumerate(attempts):
        if status is None or status < 500:
            continue
        others = statuses[:i] + statuses[i + 1 :]
        blame = blame_5xx(others[0] if others else None)
        if blame is Blame.ENGINE:
            feed.outcome(backend, False)
        elif blame is Blame.UNCONFIRMED:
            feed.answer_failed(backend, requester)
        else:
            feed.abstain(backend)
    if len(attempts) == 2 and all(status is not None and status >= 500 for status in statuses):
        (first, first_status), (second, second_status) = attempts
        log.warning(
            "%s from %s: %s from backend %s, then %s from backend %s: the request's own failure, held "
            "against neither breaker",
            what,
            requester,
            first_status,
            first,
            second_status,
            second,
        )
