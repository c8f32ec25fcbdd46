"""The simulator's KV cache events: a ZMQ PUB socket speaking vLLM's wire format (``--kv-events``).

Each change of the prefix cache (``cache.PrefixCache.on_events``) is one batch, sent as multipart
``[topic, sequence (8 bytes, big-endian), msgpack([ts, events, 0])]`` with events as maps tagged by
``"type"``, like vLLM 0.32's ``ZmqEventPublisher``. The socket is an XPUB (a PUB to its subscribers) so
``wait_subscriber`` can tell when one has subscribed: tests wait on that, not on time. It never blocks:
past its high-water mark ZMQ drops batches, and the subscriber sees a gap. No replay socket (the gateway
then treats a gap as lost).
Needs pyzmq and msgpack (the ``kv`` extra), imported when a publisher is made.
"""

from __future__ import annotations

import importlib
import itertools
import time
from typing import Any

from backends.sim.cache import KvEvent

SEND_HWM = 100_000


class KvPublisher:
    def __init__(self, endpoint: str, topic: str = "kv") -> None:
        """Bind ``endpoint`` (``tcp://127.0.0.1:*`` picks a free port: see ``endpoint``)."""
        zmq: Any = importlib.import_module("zmq")
        self._msgpack: Any = importlib.import_module("msgpack")
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._seq = itertools.count()
        self._noblock = zmq.NOBLOCK
        self._again = zmq.Again
        self._pollin = zmq.POLLIN
        self.sent = 0

    def wait_subscriber(self, timeout_s: float = 10.0) -> bool:
        """Block until a subscription arrives (True), or ``timeout_s`` passes (False)."""
        if not self._pub.poll(int(timeout_s * 1000), self._pollin):
            return False
        self._pub.recv()
        return True

    def publish(self, events: list[KvEvent]) -> None:
        payload = self._msgpack.packb([time.time(), events, 0], use_bin_type=True)
        seq = next(self._seq)
        try:
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], flags=self._noblock)
        except self._again:
            return  # dropped: the subscriber sees the gap
        self.sent += 1

    def close(self) -> None:
        self._pub.close(linger=0)
        self._ctx.term()
