"""What each engine's KV cache holds, from its own KV cache events: a pure, bounded index.

Engines that publish KV cache events (vLLM, SGLang) announce every block they cache (``Stored``: chained
block hashes, the parent of the first) and every block they drop (``Removed``, ``Cleared``).
``EngineIndex`` replays one engine's stream into a set of present blocks, each with its depth (tokens from
the start of the prompt to the end of the block; -1 when its parent was never seen).

The gateway has no tokenizer, so it cannot hash a prompt itself. It ties a conversation to blocks by
attribution instead: when a request finishes, the engine reported how many prompt tokens it had
(``usage.prompt_tokens``), so the block that ends the prompt's last full block sits at depth
``prompt_tokens // block_size * block_size``. Among the blocks that engine stored while the request ran,
the one at that depth is this conversation's checkpoint (identical prompts store one block: the same
hash). ``KvIndex.record`` keeps the last few checkpoints per conversation and engine; ``held`` answers
with the deepest checkpoint still present. Engines evict a chain's tail before its head (least recently
used, a finished request's blocks freed in reverse), so a present checkpoint means its whole prefix is
present, and a missing one means the engine dropped at least the tail.

Limits, stated:
- Granularity is one turn: ``held`` says the prefix up to some earlier turn's prompt end is present.
  Blocks the reply added (decode) are not counted, so a warm follow-up reads as held minus about one reply.
- The events of a request may arrive after its answer: attribution is retried on the engine's next few
  batches (``PENDING_TRIES``), then given up (the conversation keeps its earlier checkpoints).
- Two concurrent requests on one engine whose prompts end in the same block depth but differ: the
  checkpoint is ambiguous and not recorded (the conversation keeps its earlier checkpoints).
- A conversation is known only to the gateway replica that finished its turns (records are local); the
  block set itself is the same on every replica that read the same events.
- After a sequence gap that the replay socket did not fill, the engine's blocks are forgotten and every
  record made before it is unknown (``None``: the caller falls back to its own inference) until the
  conversation's next turn there records again. Stored blocks whose parent was forgotten have no depth
  and cannot be checkpoints until a chain from the start of a prompt is stored again.

Pure and synchronous: no clock, no I/O. Recency is insertion order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

#: A block hash as engines publish it: bytes (vLLM's sha256 default) or a 64-bit int (SGLang, vLLM option).
BlockHash = bytes | int

#: Blocks one engine's index remembers; past it the oldest stored is forgotten (read as evicted).
DEFAULT_MAX_BLOCKS = 262_144
#: Stored events kept per engine for attribution (a request's window is searched in them).
DEFAULT_RECENT_EVENTS = 4096
#: Conversations (keys) with checkpoints; past it the least recently recorded goes.
DEFAULT_MAX_CONVERSATIONS = 100_000
#: Checkpoints kept per conversation and engine: the first (the head) and the latest ones.
MAX_CHECKPOINTS = 6
#: A finished request whose blocks were not announced yet (events travel apart from the answer) is tried
#: again after each of that engine's next batches, this many times, and at most this many wait per engine.
PENDING_TRIES = 8
MAX_PENDING = 1024


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    block_size: int


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


KvEvent = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class _Recent:
    mark: int  # the engine's stored-event count when it arrived (1-based)
    first_depth: int  # depth of hashes[0]; -1 unknown
    event: Stored


class EngineIndex:
    """One engine's present blocks, fed its event batches in sequence order."""

    __slots__ = ("_blocks", "_recent", "block_size", "epoch", "expected_seq", "gaps", "marks", "max_blocks")

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS, recent: int = DEFAULT_RECENT_EVENTS) -> None:
        if max_blocks < 1 or recent < 1:
            raise ValueError("max_blocks and recent must be >= 1")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> depth, oldest stored first
        self._recent: deque[_Recent] = deque(maxlen=recent)
        self.block_size = 0  # learned from the first stored event
        self.expected_seq: int | None = None  # the next batch's sequence number
        self.epoch = 0  # bumped when the index lost track (a gap): records of older epochs are unknown
        self.gaps = 0
        self.marks = 0  # stored events applied so far: the window mark of a request sent now

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: BlockHash) -> bool:
        return block in self._blocks

    def apply(self, seq: int, events: list[KvEvent]) -> None:
        """Apply one batch read from the engine's stream.

        A batch past the expected one means batches were lost, and one before it means the engine restarted
        (its sequence starts again, its cache is empty): either way what was known is forgotten (``lose``).
        """
        if self.expected_seq is not None and seq != self.expected_seq:
            self.lose()
        self._batch(seq, events)

    def replayed(self, seq: int, events: list[KvEvent]) -> bool:
        """Apply one batch from the replay socket. False for one already applied (a replay overlapping the
        stream); one past the expected batch is a gap the replay could not fill."""
        if self.expected_seq is not None:
            if seq < self.expected_seq:
                return False
            if seq > self.expected_seq:
                self.lose()
        self._batch(seq, events)
        return True

    def _batch(self, seq: int, events: list[KvEvent]) -> None:
        self.expected_seq = seq + 1
        for event in events:
            self._apply(event)

    def lose(self) -> None:
        """Batches were lost: what is present is no longer known. Records made before now become unknown."""
        self._blocks.clear()
        self._recent.clear()
        self.epoch += 1
        self.gaps += 1

    def depth(self, block: BlockHash) -> int | None:
        """Tokens up to the end of ``block`` when present (-1: present, depth unknown); None when absent."""
        return self._blocks.get(block)

    def find(self, since_mark: int, depth: int) -> BlockHash | None:
        """The one block at ``depth`` stored after ``since_mark``; None when there is none or several."""
        found: BlockHash | None = None
        for r in reversed(self._recent):
            if r.mark <= since_mark:
                break
            bs = r.event.block_size
            if r.first_depth < 0 or not r.first_depth <= depth < r.first_depth + bs * len(r.event.hashes):
                continue
            offset = depth - r.first_depth
            if offset % bs:
                continue
            block = r.event.hashes[offset // bs]
            if found is not None and found != block:
                return None
            found = block
        return found

    def _apply(self, event: KvEvent) -> None:
        if isinstance(event, Stored):
            self._store(event)
        elif isinstance(event, Removed):
            for block in event.hashes:
                self._blocks.pop(block, None)
        else:
            self._blocks.clear()

    def _store(self, event: Stored) -> None:
        if not event.hashes or event.block_size < 1:
            return
        bs = self.block_size = event.block_size
        blocks = self._blocks
        depth = 0 if event.parent is None else blocks.get(event.parent, -1)
        first = -1 if depth < 0 else depth + bs
        for block in event.hashes:
            depth = -1 if depth < 0 else depth + bs
            blocks.pop(block, None)  # re-stored: now the most recent
            blocks[block] = depth
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
        self.marks += 1
        self._recent.append(_Recent(self.marks, first, event))


@dataclass(frozen=True, slots=True)
class Checkpoint:
    block: BlockHash
    depth: int  # tokens up to the end of the block


@dataclass(frozen=True, slots=True)
class _Record:
    epoch: int
    checkpoints: tuple[Checkpoint, ...]  # shallowest first


class KvIndex:
    """Every event-publishing engine's index, and which blocks are each conversation's checkpoints."""

    __slots__ = ("_pending", "_records", "engines", "max_blocks", "max_conversations")

    def __init__(
        self, max_blocks: int = DEFAULT_MAX_BLOCKS, max_conversations: int = DEFAULT_MAX_CONVERSATIONS
    ) -> None:
        if max_conversations < 1:
            raise ValueError("max_conversations must be >= 1")
        self.max_blocks = max_blocks
        self.max_conversations = max_conversations
        self.engines: dict[str, EngineIndex] = {}
        self._records: OrderedDict[str, dict[str, _Record]] = OrderedDict()
        self._pending: dict[str, deque[_Pending]] = {}  # backend -> finished, not yet attributed

    def __len__(self) -> int:
        return len(self._records)

    def engine(self, backend: str) -> EngineIndex:
        index = self.engines.get(backend)
        if index is None:
            index = self.engines[backend] = EngineIndex(self.max_blocks)
        return index

    def mark(self, backend: str) -> int:
        """The window mark of a request sent to ``backend`` now (0 when it publishes no events)."""
        index = self.engines.get(backend)
        return index.marks if index is not None else 0

    def record(self, keys: tuple[str, ...], backend: str, since_mark: int, prompt_tokens: int) -> bool:
        """A request sent at ``since_mark`` finished on ``backend`` with ``prompt_tokens``: the block that
        ends its prompt becomes a checkpoint of each of ``keys``. When its blocks were not announced yet, it
        is tried again on the engine's next batches (``settle``). False when it is not recorded now."""
        index = self.engines.get(backend)
        if index is None or not keys or prompt_tokens < 1:
            return False
        if self._attribute(index, keys, backend, since_mark, prompt_tokens):
            return True
        pending = self._pending.setdefault(backend, deque(maxlen=MAX_PENDING))
        pending.append(_Pending(keys, since_mark, prompt_tokens, index.epoch, PENDING_TRIES))
        return False

    def settle(self, backend: str) -> None:
        """After a batch of ``backend``'s was applied: attribute requests still waiting for their blocks."""
        pending = self._pending.get(backend)
        index = self.engines.get(backend)
        if not pending or index is None:
            return
        for _ in range(len(pending)):
            p = pending.popleft()
            if p.epoch != index.epoch or self._attribute(
                index, p.keys, backend, p.since_mark, p.prompt_tokens
            ):
                continue
            if p.tries > 1:
                pending.append(_Pending(p.keys, p.since_mark, p.prompt_tokens, p.epoch, p.tries - 1))

    def _attribute(
        self, index: EngineIndex, keys: tuple[str, ...], backend: str, since_mark: int, prompt_tokens: int
    ) -> bool:
        if index.block_size < 1:
            return False
        depth = prompt_tokens // index.block_size * index.block_size
        if depth < index.block_size:
            return False
        block = index.find(since_mark, depth)
        if block is None:
            return False
        for key in keys:
            self._checkpoint(key, backend, index.epoch, Checkpoint(block, depth))
        return True

    def _checkpoint(self, key: str, backend: str, epoch: int, checkpoint: Checkpoint) -> None:
        per_engine = self._records.pop(key, None) or {}
        self._records[key] = per_engine
        old = per_engine.get(backend)
        kept = old.checkpoints if old is not None and old.epoch == epoch else ()
        kept = tuple(c for c in kept if c.depth < checkpoint.depth)
        if len(kept) >= MAX_CHECKPOINTS:
            kept = kept[:1] + kept[2 - MAX_CHECKPOINTS :]
        per_engine[backend] = _Record(epoch, (*kept, checkpoint))
        if len(self._records) > self.max_conversations:
            self._records.popitem(last=False)

    def held(self, key: str, backend: str) -> int | None:
        """Prompt tokens of ``key``'s last recorded prompt that ``backend`` still holds; None: unknown."""
        found = self._held(key, backend)
        return None if found is None else found[0]

    def snapshot(self, key: str) -> tuple[tuple[str, int, bool], ...]:
        """``(backend, held tokens, whole)`` for every engine known for ``key``, sorted by backend; ``whole``:
        it still holds the latest recorded prompt (and, most likely, the reply that followed it)."""
        per_engine = self._records.get(key)
        if not per_engine:
            return ()
        out = []
        for backend in sorted(per_engine):
            found = self._held(key, backend)
            if found is not None:
                out.append((backend, *found))
        return tuple(out)

    def _held(self, key: str, backend: str) -> tuple[int, bool] | None:
        per_engine = self._records.get(key)
        record = per_engine.get(backend) if per_engine is not None else None
        index = self.engines.get(backend)
        if record is None or index is None or record.epoch != index.epoch:
            return None
        latest = record.checkpoints[-1]
        for checkpoint in reversed(record.checkpoints):
            if checkpoint.block in index:
                return checkpoint.depth, checkpoint is latest
        return 0, False


@dataclass(frozen=True, slots=True)
class _Pending:
    keys: tuple[str, ...]
    since_mark: int
    prompt_tokens: int
    epoch: int
    tries: int
