"""How an upstream attempt and a whole request ended. The values are metric labels: keep them stable.

A request makes one or two attempts (a retry on the next backend when the first fails before answering), so
the two are counted apart: ``warmroute_upstream_attempts_total`` and ``warmroute_requests_total``.
"""

from __future__ import annotations

from enum import StrEnum


class AttemptOutcome(StrEnum):
    """One upstream attempt, judged when the response head arrived or the attempt failed."""

    OK = "ok"  # a response head below 500 (a 4xx from the engine is an answer, not a failure)
    HTTP_5XX = "http_5xx"
    CONNECT_ERROR = "connect_error"  # nothing was sent
    POOL_TIMEOUT = "pool_timeout"  # every connection to that engine stayed busy; nothing was sent
    TIMEOUT = "timeout"  # no response head within the first-byte budget
    BROKEN = "broken"  # the connection broke or the engine sent garbage before the head


class RequestOutcome(StrEnum):
    """One client request, judged when its last byte was sent (or it could not be)."""

    OK = "ok"
    HTTP_4XX = "http_4xx"  # the engine's own 4xx, relayed
    HTTP_5XX = "http_5xx"  # the engine's own 5xx, relayed (nobody else to ask)
    REJECTED = "rejected"  # the gateway refused it before routing (bad input, unknown model, too large)
    NO_BACKEND = "no_backend"  # 503: nothing ready serves the model
    UPSTREAM_ERROR = "upstream_error"  # 502: every attempt failed before an answer
    UPSTREAM_TIMEOUT = "upstream_timeout"  # 504
    MID_STREAM_ERROR = "mid_stream_error"  # the engine broke or fell silent after the answer began
    CLIENT_DISCONNECT = "client_disconnect"


#: The label used where no backend was chosen.
NO_BACKEND_LABEL = ""
