"""Request headers read on the hot path: a header sent twice counts with its first value (its first one
not empty, for what the engine gets)."""

from __future__ import annotations

from gateway.inbound import first_values
from gateway.relay import upstream_headers


def test_the_engine_gets_the_first_accept_request_id_and_authorization_sent() -> None:
    client = [
        (b"accept", b"text/event-stream"),
        (b"x-request-id", b"r1"),
        (b"authorization", b"Bearer c1"),
        (b"accept", b"*/*"),
        (b"x-request-id", b"r2"),
        (b"authorization", b"Bearer c2"),
    ]
    assert upstream_headers(client, first_values(client), None) == [
        (b"content-type", b"application/json"),
        (b"accept", b"text/event-stream"),
        (b"accept-encoding", b"identity"),
        (b"authorization", b"Bearer c1"),
        (b"x-request-id", b"r1"),
    ]
    assert (b"authorization", b"Bearer c1") not in upstream_headers(
        client, first_values(client), None, forward_auth=False
    )
    assert (b"authorization", b"Bearer k") in upstream_headers(
        client, first_values(client), "k", forward_auth=False
    )


def test_a_header_sent_empty_first_counts_with_its_next_value() -> None:
    client = [(b"accept", b""), (b"x-request-id", b""), (b"accept", b"a/b"), (b"x-request-id", b"r2")]
    sent = dict(upstream_headers(client, first_values(client), None))
    assert sent[b"accept"] == b"a/b" and sent[b"x-request-id"] == b"r2"
    assert dict(upstream_headers([(b"accept", b"")], {b"accept": b""}, None))[b"accept"] == b"*/*"


def test_first_values_are_each_headers_first() -> None:
    first = first_values([(b"content-length", b"5"), (b"x", b"1"), (b"content-length", b"7")])
    assert first[b"content-length"] == b"5" and first.get(b"y") is None
