"""The KV block pool: fixed-size blocks, per-sequence block tables, ref counts, prefix caching.

Prefix caching is always on. A block that is full of computed tokens is registered under a
chained hash (hash of the previous block's hash and this block's tokens), so a new prompt that
starts with the same tokens finds the same blocks. When a sequence lets go of a block whose
content is cached, the block is not wiped: it joins an LRU list of evictable blocks and is only
reused (and forgotten) when no never-cached block is free. Cost when nothing is shared: one hash
per 16 tokens. A sequence may give its chain a root (`salt`): blocks are then shared only among
sequences with the same one (LongRoPE: a long prompt's keys are rotated otherwise than a short
one's, the same tokens or not).

A block is in exactly one place: its pages back in the pool's free list (ref 0, no content worth
keeping), `_evictable` (ref 0, cached content, LRU order) or referenced by at least one sequence
(ref > 0).

Copy-on-write: sequences can share a partially filled last block (`fork`). The first one to
write into it gets a private copy; the copy (src, dst) is queued in `pending_copies` and the
model runner performs it before the step's forward pass.

A sequence's table list only ever grows in place (append); any other change (copy-on-write,
truncate) puts a new list in its place. The model runner relies on it to update its device
block tables incrementally (same list object and length: nothing changed).

Sliding-window layers (`window`): attention reads only a sequence's last `window` positions, so
the blocks wholly behind that are given back as the sequence advances ("dropped"). Their ids stay
in the table (it still only grows; no attention kernel uses a position outside the window, and a
stale id names a block of finite values). Dropped blocks keep their place in the prefix cache
until evicted, and a prefix hit there needs only the blocks of the window before the first token
to compute: `match_prefix` returns None for the leading blocks it does not need. `SplitBlockManager`
gives the full-attention layers and the sliding layers (Gemma 3: five layers of six slide over
1,024 tokens) tables of their own, their blocks made of pages from one shared PagePool: a prefix
is a hit where both kinds hold what they need of it.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence


@dataclass
class Block:
    id: int
    ref: int = 0
    hash: Optional[int] = None  # set while the block is registered in the prefix cache
    parent: Optional[int] = None  # the hash it was chained on (collision check)
    tokens: tuple[int, ...] = ()  # its tokens (collision check: a 64-bit hash is not a proof)


@dataclass
class SeqBlocks:
    """What the pool knows about one sequence."""

    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of its first full blocks
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    salt: Optional[int] = None  # the chain's root (see the module docstring)
    num_dropped: int = 0  # leading blocks given back: behind the sliding window (ids left in the table)


def chain_hash(parent: Optional[int], tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class PagePool:
    """The memory a KV cache's blocks are made of: `num_pages` pages. A BlockManager has a pool of its
    own (its blocks are its pages), or shares one with the others of a SplitBlockManager, whose
    blocks are `width` pages each (SplitKVCache: a page holds its block_size tokens for a few
    layers). A page is free, or part of one block of one member (referenced, or evictable: ref 0
    with content the prefix cache keeps). When too few are free, the members' least recently
    released evictable blocks give theirs back, oldest first across all members."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free: deque[int] = deque(range(num_pages))
        self.members: list["BlockManager"] = []
        self.clock = itertools.count()  # orders evictable blocks across members

    @property
    def available(self) -> int:
        """Pages an allocation can have: free, or held by an evictable block."""
        return len(self.free) + sum(m.width * len(m._evictable) for m in self.members)

    def take(self, n: int) -> list[int]:
        while len(self.free) < n:
            holders = [m for m in self.members if m._evictable]
            if not holders:  # (callers check can_allocate first)
                raise RuntimeError(f"KV page pool: {n} pages asked, {len(self.free)} free and none evictable")
            min(holders, key=lambda m: next(iter(m._evictable.values())))._evict_oldest()
        return [self.free.popleft() for _ in range(n)]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, window: Optional[int] = None,
                 pool: Optional[PagePool] = None, width: int = 1):
        """`pool`/`width`: blocks of `width` pages from a shared PagePool (then num_blocks is ignored: a
        block is named by its first page; the others are `pages(block)`)."""
        if (num_blocks < 1 and pool is None) or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        if window is not None and window < 1:
            raise ValueError(f"a sliding window of {window} tokens: must be at least 1")
        self.pool = PagePool(num_blocks) if pool is None else pool
        self.pool.members.append(self)
        self.width = width
        self.num_blocks = self.pool.num_pages // width  # as many as fit if this member had every page
        self.block_size, self.window = block_size, window
        self.blocks = [Block(i) for i in range(self.pool.num_pages)]
        self._extra: dict[int, tuple[int, ...]] = {}  # a block's pages after its first (width > 1)
        self.new_pages: list[int] = []  # blocks given pages since take_new_pages (width > 1)
        self._evictable: OrderedDict[int, int] = OrderedDict()  # -> pool.clock at release; oldest first
        self._cached: dict[int, int] = {}  # chain hash -> block id
        self._num_held = 0  # blocks with ref > 0
        self.seqs: dict[Hashable, SeqBlocks] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.query_tokens = 0  # prefix-cache statistics, in tokens
        self.hit_tokens = 0

    # ---- the scheduler's interface ------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take right now (free or evictable pages)."""
        return self.pool.available // self.width

    @property
    def num_used_blocks(self) -> int:
        return self._num_held

    def pages(self, block_id: int) -> tuple[int, ...]:
        """The pages a block is made of (its first is its id)."""
        return (block_id, *self._extra.get(block_id, ()))

    def take_new_pages(self) -> list[tuple[int, tuple[int, ...]]]:
        """(block, its pages) for the blocks given pages since the last call, each once."""
        new, self.new_pages = self.new_pages, []
        return [(b, self.pages(b)) for b in dict.fromkeys(new)]

    def table(self, seq_id: Hashable) -> list[int]:
        return self.seqs[seq_id].table

    def match_prefix(self, seq_id: Hashable, token_ids: Sequence[int], max_tokens: int,
                     salt: Optional[int] = None) -> list[Optional[int]]:
        """Cached blocks holding the longest prefix of `token_ids` (whole blocks, at most
        `max_tokens` tokens) under this `salt`. With a window, the blocks of that prefix wholly
        behind the window of its end are not needed: None stands for each (they lead the list).
        Takes nothing: pass the result to `allocate`."""
        seq = self._seq(seq_id, salt)
        self._extend_hashes(seq, token_ids, max_tokens // self.block_size)
        hits: list[Optional[int]] = []
        for i, h in enumerate(seq.hashes[: max_tokens // self.block_size]):
            block_id = self._cached.get(h)
            if block_id is None or not self._same_content(block_id, self._parent(seq, i), token_ids, i):
                if self.window is None:
                    break
                block_id = None  # a gap: only a prefix ending a window later can use what follows
            hits.append(block_id)
        if self.window is None:
            return hits
        # The longest prefix whose window (the blocks a token right after it still sees) has no gap.
        gaps = [i for i, b in enumerate(hits) if b is None]
        for end in range(len(hits), 0, -1):
            while gaps and gaps[-1] >= end:
                gaps.pop()
            need = self._behind_window(end * self.block_size)
            if not gaps or gaps[-1] < need:
                return [None] * need + hits[need:end]
        return []

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    def can_allocate(self, seq_id: Hashable, num_computed: int, num_new: int, prefix: Sequence[int] = ()) -> bool:
        return self.pages_short(seq_id, num_computed, num_new, prefix) <= self.pool.available

    def pages_short(self, seq_id: Hashable, num_computed: int, num_new: int, prefix: Sequence[int] = ()) -> int:
        """How many of the pool's available pages `allocate` would use up (net of what it gives back)."""
        needed = self._blocks_needed(seq_id, num_computed, num_new, prefix)
        seq = self.seqs.get(seq_id)
        # Blocks this call drops behind the window come free first, unless another sequence (a fork) holds them too.
        freed = sum(1 for i in self._droppable(seq, num_computed) if self.blocks[seq.table[i]].ref == 1)
        return (needed - freed + self._evictable_in(prefix)) * self.width

    def allocate(self, seq_id: Hashable, num_computed: int, num_new: int, prefix: Sequence[int] = (),
                 salt: Optional[int] = None) -> bool:
        """Make the sequence's table cover `num_computed + num_new` tokens, where the K/V of the
        `num_new` tokens from position `num_computed` on are about to be written. `prefix` (from
        `match_prefix`, for a sequence holding no blocks yet; then `num_computed` counts its
        tokens) is shared rather than allocated. `salt`: the chain root of a new sequence (as in
        match_prefix). False, changing nothing, when the pool is short."""
        if not prefix and self.writes_in_place(seq_id, num_computed, num_new):
            return True  # the common decode step: nothing to take, copy or forget
        if not self.can_allocate(seq_id, num_computed, num_new, prefix):
            return False
        self._claim(seq_id, num_computed, prefix, salt)
        self._grow(seq_id, num_computed, num_new)
        return True

    def _claim(self, seq_id: Hashable, num_computed: int, prefix: Sequence[int], salt: Optional[int]) -> None:
        """allocate's first half: take the prefix's blocks and drop what falls behind the window (so no
        page taken in the second half can come from evicting them)."""
        seq = self._seq(seq_id, salt)
        if prefix:
            assert not seq.table and num_computed == len(prefix) * self.block_size
            # (blocks of a windowed prefix that are not needed: a stale id of the prefix stands in)
            stand_in = next((b for b in prefix if b is not None), 0)
            seq.table.extend(stand_in if b is None else self._take(b) for b in prefix)
            seq.num_dropped = sum(1 for b in prefix if b is None)
            seq.num_registered = len(prefix)
        self._drop_behind_window(seq, num_computed)

    def _grow(self, seq_id: Hashable, num_computed: int, num_new: int) -> None:
        """allocate's second half: a private copy of a shared block written to, and new blocks."""
        seq = self.seqs[seq_id]
        if self._needs_copy(seq, num_computed, num_new):
            self._copy_on_write(seq, num_computed // self.block_size)
        self._forget_overwritten(seq, num_computed, num_new)
        while len(seq.table) * self.block_size < num_computed + num_new:
            seq.table.append(self._take(self._pop_free()))

    def cache_full_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Offer the sequence's blocks that are now full of computed tokens to the prefix cache.
        Call after the forward pass: a block is shareable only once its K/V are written."""
        seq = self.seqs[seq_id]
        num_full = min(num_computed // self.block_size, len(seq.table))
        if num_full <= seq.num_registered:
            return  # no block filled up since the last call (most decode steps)
        self._extend_hashes(seq, token_ids, num_full)
        # (Not the blocks already dropped behind the window, which an allocation made before this call
        # can have given back: the engine's look-ahead allocates step N + 1 before it caches step N.)
        for i in range(max(seq.num_registered, seq.num_dropped), num_full):
            block = self.blocks[seq.table[i]]
            if block.hash is None and seq.hashes[i] not in self._cached:
                # (Same content already cached under another block: keep ours private; it
                # returns to the free list when released.)
                block.hash, block.parent = seq.hashes[i], self._parent(seq, i)
                block.tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
                self._cached[block.hash] = block.id
        seq.num_registered = max(seq.num_registered, num_full)

    def free(self, seq_id: Hashable) -> None:
        """Release all of a sequence's blocks. Tail first, so that under LRU a sequence's later
        blocks (less likely to be shared) are evicted before its earlier ones."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            for block_id in reversed(seq.table[seq.num_dropped:]):
                self._release(block_id)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares every block of the parent (e.g. parallel samples of one prompt)."""
        parent = self.seqs[parent_id]
        assert child_id not in self.seqs or not self.seqs[child_id].table
        for block_id in parent.table[parent.num_dropped:]:
            self.blocks[block_id].ref += 1
        self.seqs[child_id] = SeqBlocks(list(parent.table), list(parent.hashes), parent.num_registered,
                                        salt=parent.salt, num_dropped=parent.num_dropped)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens (rejected draft tokens are rolled back)."""
        seq = self.seqs[seq_id]
        keep = -(-num_tokens // self.block_size)
        if keep < seq.num_dropped:
            raise ValueError(f"truncating to {num_tokens} tokens needs blocks already dropped behind the window")
        for block_id in reversed(seq.table[keep:]):
            self._release(block_id)
        seq.table = seq.table[:keep]  # a new list: see the module docstring
        full = num_tokens // self.block_size
        del seq.hashes[full:]
        seq.num_registered = min(seq.num_registered, full)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    # ---- internals ------------------------------------------------------------------------------
    def _blocks_needed(self, seq_id: Hashable, num_computed: int, num_new: int, prefix: Sequence[int]) -> int:
        seq = self.seqs.get(seq_id)
        held = (len(seq.table) if seq else 0) + len(prefix)
        needed = max(0, -(-(num_computed + num_new) // self.block_size) - held)
        return needed + (1 if seq is not None and self._needs_copy(seq, num_computed, num_new) else 0)

    def _droppable(self, seq: Optional[SeqBlocks], num_computed: int) -> range:
        """Table indices of the blocks behind the window that `allocate(num_computed, ...)` gives
        back: every position in them is at least `window` before the first token still to be
        written (num_computed), so no query from here on sees them (a rolled-back draft only goes
        back to num_computed)."""
        if self.window is None or seq is None:
            return range(0)
        return range(seq.num_dropped, min(self._behind_window(num_computed), len(seq.table)))

    def _behind_window(self, position: int) -> int:
        """How many leading blocks lie wholly behind the window of a query at `position`."""
        return max(0, position - self.window + 1) // self.block_size

    def _drop_behind_window(self, seq: SeqBlocks, num_computed: int) -> None:
        dropped = self._droppable(seq, num_computed)
        for i in reversed(dropped):
            self._release(seq.table[i])
        seq.num_dropped = max(seq.num_dropped, dropped.stop)

    def _evictable_in(self, prefix: Sequence[int]) -> int:
        """Prefix hits sitting in the evictable list stop being available once taken."""
        return sum(1 for b in prefix if b in self._evictable)

    def writes_in_place(self, seq_id: Hashable, num_computed: int, num_new: int) -> bool:
        """The table already covers the new tokens and the block they start in is this
        sequence's alone and not in the prefix cache: `allocate` would change nothing."""
        seq = self.seqs.get(seq_id)
        i = num_computed // self.block_size
        if seq is None or num_new <= 0 or num_computed + num_new > len(seq.table) * self.block_size:
            return False
        block = self.blocks[seq.table[i]]
        return block.ref == 1 and block.hash is None

    def _needs_copy(self, seq: SeqBlocks, num_computed: int, num_new: int) -> bool:
        """The first block written to is shared: writing would change what the others read."""
        i = num_computed // self.block_size
        return num_new > 0 and i < len(seq.table) and self.blocks[seq.table[i]].ref > 1

    def _forget_overwritten(self, seq: SeqBlocks, num_computed: int, num_new: int) -> None:
        """The block the new tokens start in is this sequence's alone now (after any copy); if it
        is registered in the prefix cache, writing makes that entry stale (e.g. after truncate)."""
        i = num_computed // self.block_size
        if num_new > 0 and i < len(seq.table):
            self._forget(self.blocks[seq.table[i]])

    def _copy_on_write(self, seq: SeqBlocks, i: int) -> None:
        src = seq.table[i]
        dst = self._take(self._pop_free())
        self.pending_copies.append((src, dst))
        self._release(src)
        seq.table = seq.table[:i] + [dst] + seq.table[i + 1:]  # a new list: see the module docstring

    def _seq(self, seq_id: Hashable, salt: Optional[int]) -> SeqBlocks:
        """The sequence's record; a new one takes `salt` as its chain root."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            seq = self.seqs[seq_id] = SeqBlocks(salt=salt)
        return seq

    @staticmethod
    def _parent(seq: SeqBlocks, i: int) -> Optional[int]:
        """The hash block i is chained on: the previous block's, or the chain's root."""
        return seq.hashes[i - 1] if i else seq.salt

    def _extend_hashes(self, seq: SeqBlocks, token_ids: Sequence[int], num_full: int) -> None:
        num_full = min(num_full, len(token_ids) // self.block_size)
        bs = self.block_size
        while len(seq.hashes) < num_full:
            i = len(seq.hashes)
            seq.hashes.append(chain_hash(self._parent(seq, i), tuple(token_ids[i * bs:(i + 1) * bs])))

    def _same_content(self, block_id: int, parent: Optional[int], token_ids: Sequence[int], i: int) -> bool:
        block = self.blocks[block_id]
        return block.parent == parent and block.tokens == tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _pop_free(self) -> int:
        """A block to overwrite: never-cached pages if any, else the least recently used cached block's."""
        pages = self.pool.take(self.width)
        if self.width > 1:
            self._extra[pages[0]] = tuple(pages[1:])
            self.new_pages.append(pages[0])
        return pages[0]

    def _evict_oldest(self) -> None:
        block_id, _ = self._evictable.popitem(last=False)
        self._forget(self.blocks[block_id])
        self._give_back(block_id)

    def _give_back(self, block_id: int) -> None:
        self.pool.free.extend(self.pages(block_id))
        self._extra.pop(block_id, None)

    def _take(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref == 0:
            self._evictable.pop(block_id, None)
            self._num_held += 1
        block.ref += 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref > 0, f"block {block_id} freed twice"
        block.ref -= 1
        if block.ref == 0:
            self._num_held -= 1
            if block.hash is not None:
                self._evictable[block_id] = next(self.pool.clock)  # most recently used end
            else:
                self._give_back(block_id)

    def _forget(self, block: Block) -> None:
        """Drop a block from the prefix cache (it is about to be overwritten)."""
        if block.hash is not None and self._cached.get(block.hash) == block.id:
            del self._cached[block.hash]
        block.hash, block.parent, block.tokens = None, None, ()


class SplitBlockManager:
    """Two kinds of blocks over one PagePool, behind the scheduler's interface: `full` for the
    full-attention layers and `window` (a BlockManager with a window) for the sliding ones, each
    with its own table per sequence and blocks of `widths` pages (SplitKVCache: a page holds its
    block_size tokens for a few layers). A sequence is given room in both or in neither. The pages a
    sequence's sliding blocks give back behind its window serve either kind, so the memory goes
    where the running sequences need it: short ones hold as much of both as one shared pool would,
    long ones mostly the full layers'. A cached prefix is used as far as both hold what they need
    of it. No fork."""

    def __init__(self, num_pages: int, block_size: int, window: int, widths: tuple[int, int] = (1, 1)):
        if num_pages < sum(widths):
            raise ValueError(f"{num_pages} pages: fewer than one block of each kind ({widths[0]} + {widths[1]} pages)")
        self.pool = PagePool(num_pages)
        self.full = BlockManager(0, block_size, pool=self.pool, width=widths[0])
        self.window = BlockManager(0, block_size, window, pool=self.pool, width=widths[1])
        self.block_size, self.num_blocks, self.widths = block_size, num_pages, widths  # (num_blocks: pages)
        self._window_hits: dict[Hashable, list[Optional[int]]] = {}  # match_prefix's, for allocate
        self.query_tokens = self.hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Sequences that could each take one more block of both kinds right now."""
        return self.pool.available // sum(self.widths)

    @property
    def num_used_blocks(self) -> int:
        """Pages held by sequences (the unit of num_blocks)."""
        return self.full.num_used_blocks * self.widths[0] + self.window_pages_used

    @property
    def window_pages_used(self) -> int:
        return self.window.num_used_blocks * self.widths[1]

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def table(self, seq_id: Hashable) -> list[int]:
        return self.full.table(seq_id)

    def window_table(self, seq_id: Hashable) -> list[int]:
        return self.window.table(seq_id)

    def match_prefix(self, seq_id: Hashable, token_ids: Sequence[int], max_tokens: int,
                     salt: Optional[int] = None) -> list[int]:
        """The full blocks' hits for the longest prefix both kinds hold (the sliding ones: its
        window's blocks); the sliding blocks' wait for `allocate`."""
        full = self.full.match_prefix(seq_id, token_ids, max_tokens, salt)
        window = self.window.match_prefix(seq_id, token_ids, len(full) * self.block_size, salt)
        self._window_hits[seq_id] = window
        return full[:len(window)]

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    def can_allocate(self, seq_id: Hashable, num_computed: int, num_new: int, prefix: Sequence[int] = ()) -> bool:
        short = (self.full.pages_short(seq_id, num_computed, num_new, prefix)
                 + self.window.pages_short(seq_id, num_computed, num_new, self._window_prefix(seq_id, prefix)))
        return short <= self.pool.available

    def allocate(self, seq_id: Hashable, num_computed: int, num_new: int, prefix: Sequence[int] = (),
                 salt: Optional[int] = None) -> bool:
        if not prefix and all(m.writes_in_place(seq_id, num_computed, num_new) for m in (self.full, self.window)):
            return True  # the common decode step, as BlockManager.allocate's (without checking both first)
        if not self.can_allocate(seq_id, num_computed, num_new, prefix):
            return False
        window_prefix = self._window_prefix(seq_id, prefix)
        self._window_hits.pop(seq_id, None)
        # Both prefixes are taken (and both windows' dropped blocks given back) before either kind takes
        # new pages: those could otherwise come from evicting the other kind's prefix hits.
        self.full._claim(seq_id, num_computed, prefix, salt)
        self.window._claim(seq_id, num_computed, window_prefix, salt)
        self.full._grow(seq_id, num_computed, num_new)
        self.window._grow(seq_id, num_computed, num_new)
        return True

    def _window_prefix(self, seq_id: Hashable, prefix: Sequence[int]) -> list[Optional[int]]:
        if not prefix:
            return []
        window = self._window_hits.get(seq_id, [])
        assert len(window) == len(prefix), "a prefix from match_prefix, for the same sequence"
        return window

    def cache_full_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        self.full.cache_full_blocks(seq_id, token_ids, num_computed)
        self.window.cache_full_blocks(seq_id, token_ids, num_computed)

    def free(self, seq_id: Hashable) -> None:
        self._window_hits.pop(seq_id, None)
        self.full.free(seq_id)
        self.window.free(seq_id)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        self.full.truncate(seq_id, num_tokens)
        self.window.truncate(seq_id, num_tokens)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies of both kinds, as (source, destination) page pairs."""
        return [pair for m in (self.full, self.window) for src, dst in m.take_copies()
                for pair in zip(m.pages(src), m.pages(dst))]

    def take_new_pages(self) -> tuple[list, list]:
        """(full, sliding) blocks given pages since the last call: BlockManager.take_new_pages."""
        return self.full.take_new_pages(), self.window.take_new_pages()
