"""The per-process Responses store, like vLLM's with ``VLLM_ENABLE_RESPONSES_API_STORE=1``: a dict in this
engine process, so ``previous_response_id`` works only on the process that produced the response, and not
after a restart.

Unlike vLLM's (which never forgets), it keeps at most ``capacity`` responses, oldest dropped first, so a
long benchmark cannot grow it without bound.

Leaf module: imports nothing from the package.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 10_000


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as answered
    conversation: tuple[dict[str, Any], ...]  # chat messages after instructions, with the reply appended
    input_items: tuple[dict[str, Any], ...]  # this request's input, as items with ids


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def put(self, stored: StoredResponse) -> None:
        self._items[str(stored.response["id"])] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
