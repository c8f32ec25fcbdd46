"""AffinityTable: conversation key -> backend, with a TTL and a bound on entries.

Pure and synchronous: the caller passes ``now``. Built for a million pins in a proxy that must not pause:

- Pins live in *generations*: plain dicts of key -> backend index, one per ``ttl_s / GENERATIONS`` of time.
  A use moves a pin into the current generation; a whole generation expires at once, ``ttl_s`` after the
  latest use of any pin in it (one float per generation, none per pin). So a pin lives at least ``ttl_s``
  after its last use and at most ``ttl_s * (1 + 1 / GENERATIONS)``, and a pin just used expires in exactly
  ``ttl_s``, as Redis's ``PEXPIRE`` would have it.
- Values are small ints (indexes into the backend names), never tuples or floats: nothing is allocated per
  pin but its key, and a dict holding only strings and small ints is not tracked by the garbage collector,
  so a full collection does not walk the table (an OrderedDict of tuples cost ~60 ms per collection at 1 M
  pins, and ~320 MB; these dicts ~150 MB).
- Past ``max_entries`` the oldest generation gives up pins first (within it, in no particular order).
- Per-backend counts of pinned conversations are kept incrementally, per generation too, so expiring a
  generation costs one subtraction per backend.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

GENERATIONS = 8


class _Generation:
    __slots__ = ("counts", "last", "pins", "start")

    def __init__(self, start: float) -> None:
        self.start = start  # every pin in it was last used in [start, start + width)
        self.last = start  # the latest of those uses: the generation expires at last + ttl_s
        self.pins: dict[str, int] = {}  # key -> backend index
        self.counts: dict[int, int] = {}  # backend index -> pins in this generation


class AffinityTable:
    __slots__ = ("_counts", "_gens", "_index", "_len", "_names", "_width", "max_entries", "ttl_s")

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError("ttl_s must be > 0 and max_entries >= 1")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._width = ttl_s / GENERATIONS
        self._gens: deque[_Generation] = deque()  # oldest first
        self._names: list[str] = []  # backend index -> id
        self._index: dict[str, int] = {}  # backend id -> index
        self._counts: dict[str, int] = {}  # backend id -> pinned conversations (no zero entries)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def get(self, key: str, now: float) -> str | None:
        """The pinned backend, or None. Does not refresh the entry (``touch`` does)."""
        self.expire(now)
        found = self._find(key)
        return None if found is None else self._names[found[1]]

    def touch(self, key: str, now: float) -> None:
        found = self._find(key)
        if found is not None:
            gen, index = found
            current = self._current(now)
            if gen is not current:
                self._drop(gen, key, index)
                self._put(current, key, index)

    def claim(self, key: str, backend: str, now: float) -> str:
        """First assignment: pin ``key`` to ``backend`` unless already pinned. Returns the winner."""
        self.expire(now)
        found = self._find(key)
        if found is not None:
            self.touch(key, now)
            return self._names[found[1]]
        self._insert(key, backend, now)
        return backend

    def move(self, key: str, backend: str, now: float) -> None:
        """Pin ``key`` to ``backend`` whatever it was pinned to."""
        # ``expire``, ``take``, ``_insert``, ``_current`` and ``_put`` inline, one frame: once per request of
        # a policy that counts conversations between turns (each call was about a thousand instructions).
        gens, ttl_s = self._gens, self.ttl_s
        while gens and gens[0].last + ttl_s <= now:
            self._discard(gens.popleft())
        names, total = self._names, self._counts
        for gen in reversed(gens):
            old = gen.pins.pop(key, None)
            if old is not None:
                self._uncount(gen, old, 1)
                break
        index = self._index.get(backend)
        if index is None:
            index = self._index[backend] = len(names)
            names.append(backend)
        if not gens or now >= gens[-1].start + self._width:
            gens.append(_Generation(now))
        gen = gens[-1]
        if now > gen.last:  # a caller's ``now`` read before an await may be a little older
            gen.last = now
        gen.pins[key] = index
        counts = gen.counts
        counts[index] = counts.get(index, 0) + 1
        name = names[index]
        total[name] = total.get(name, 0) + 1
        self._len += 1
        if self._len > self.max_entries:
            self._trim()

    def forget(self, key: str) -> str | None:
        """Drop the pin of ``key`` (an operator's request); the backend it named, or None."""
        found = self._find(key)
        if found is None:
            return None
        self._drop(found[0], key, found[1])
        return self._names[found[1]]

    def discard(self, key: str) -> None:
        """Drop ``key``'s pin, if any."""
        self.take(key)

    def take(self, key: str) -> float | None:
        """Drop ``key``'s pin, if any, and say when it would have expired (``entry``'s second item), or
        None: ``entry`` then ``discard`` in one walk of the generations (once per request of a policy that
        counts conversations between their turns)."""
        for gen in reversed(self._gens):  # ``_find``, ``_drop`` and ``_uncount`` inline
            index = gen.pins.pop(key, None)
            if index is not None:
                counts = gen.counts
                left = counts[index] - 1
                if left:
                    counts[index] = left
                else:
                    del counts[index]
                total, name = self._counts, self._names[index]
                left = total[name] - 1
                if left:
                    total[name] = left
                else:
                    del total[name]
                self._len -= 1
                return gen.last + self.ttl_s
        return None

    def forget_backend(self, backend: str) -> int:
        """Drop every pin to ``backend`` (it was removed from the config). Returns how many."""
        index = self._index.get(backend)
        if index is None:
            return 0
        dropped = 0
        for gen in self._gens:
            doomed = [k for k, i in gen.pins.items() if i == index]
            for k in doomed:
                self._drop(gen, k, index)
            dropped += len(doomed)
        return dropped

    def entry(self, key: str) -> tuple[str, float] | None:
        """(backend, expires_at) of ``key`` as stored, without expiring or refreshing anything."""
        found = self._find(key)
        if found is None:
            return None
        gen, index = found
        return self._names[index], self._expiry(gen)

    def items(self) -> list[tuple[str, str, float]]:
        """A copy of every (key, backend, expires_at), oldest first: to write the table to a shared store."""
        names = self._names
        return [(k, names[i], self._expiry(gen)) for gen in self._gens for k, i in gen.pins.items()]

    def counts(self) -> Mapping[str, int]:
        """Pinned conversations per backend (a live view; copy it to keep it)."""
        return self._counts

    def live_counts(self, now: float) -> Mapping[str, int]:
        """``expire(now)``, then ``counts()``: one call (once per request of a policy that counts them)."""
        gens, ttl_s = self._gens, self.ttl_s
        while gens and gens[0].last + ttl_s <= now:
            self._discard(gens.popleft())
        return self._counts

    def recent_counts(self, since: float) -> dict[str, int]:
        """Pins per backend used at ``since`` or later, by whole generations: one whose latest use is at
        ``since`` or later counts whole, so a pin used up to one generation's width earlier may count too."""
        out: dict[str, int] = {}
        names = self._names
        for gen in reversed(self._gens):
            if gen.last < since:
                break
            for index, n in gen.counts.items():
                name = names[index]
                out[name] = out.get(name, 0) + n
        return out

    @property
    def width_s(self) -> float:
        """A generation's span of time: the granularity of ``recent_counts``."""
        return self._width

    def expire(self, now: float) -> None:
        gens, ttl_s = self._gens, self.ttl_s
        while gens and gens[0].last + ttl_s <= now:  # ``_expiry`` inline: asked several times a request
            self._discard(gens.popleft())

    # -- internals ------------------------------------------------------------------------------------

    def _expiry(self, gen: _Generation) -> float:
        return gen.last + self.ttl_s

    def _find(self, key: str) -> tuple[_Generation, int] | None:
        for gen in reversed(self._gens):  # recent pins are the ones asked for most
            index = gen.pins.get(key)
            if index is not None:
                return gen, index
        return None

    def _current(self, now: float) -> _Generation:
        """The generation a use at ``now`` goes into (every caller uses a pin at ``now``)."""
        gens = self._gens
        if not gens or now >= gens[-1].start + self._width:
            gens.append(_Generation(now))
        gen = gens[-1]
        if now > gen.last:  # a caller's ``now`` read before an await may be a little older
            gen.last = now
        return gen

    def _insert(self, key: str, backend: str, now: float) -> None:
        index = self._index.get(backend)
        if index is None:
            index = self._index[backend] = len(self._names)
            self._names.append(backend)
        self._put(self._current(now), key, index)
        if self._len > self.max_entries:
            self._trim()

    def _trim(self) -> None:
        """Past ``max_entries``: the oldest generation gives up pins first."""
        while self._len > self.max_entries:
            oldest = self._gens[0]
            if not oldest.pins:
                self._gens.popleft()
                continue
            _, i = oldest.pins.popitem()
            self._uncount(oldest, i, 1)

    def _put(self, gen: _Generation, key: str, index: int) -> None:
        gen.pins[key] = index
        gen.counts[index] = gen.counts.get(index, 0) + 1
        name = self._names[index]
        self._counts[name] = self._counts.get(name, 0) + 1
        self._len += 1

    def _drop(self, gen: _Generation, key: str, index: int) -> None:
        del gen.pins[key]
        self._uncount(gen, index, 1)

    def _discard(self, gen: _Generation) -> None:
        """A whole generation expired: one subtraction per backend, whatever its size."""
        for index, n in list(gen.counts.items()):
            self._uncount(gen, index, n)

    def _uncount(self, gen: _Generation, index: int, n: int) -> None:
        left = gen.counts[index] - n
        if left:
            gen.counts[index] = left
        else:
            del gen.counts[index]
        name = self._names[index]
        left = self._counts[name] - n
        if left:
            self._counts[name] = left
        else:
            del self._counts[name]
        self._len -= n
