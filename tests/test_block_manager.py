"""Block pool invariants under random allocate / compute / fork / truncate / free sequences, with
and without a sliding window (blocks behind it given back)."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from fitllm.serve.block_manager import BlockManager, SplitBlockManager

BS = 4


def check_invariants(bm: BlockManager) -> None:
    """Every page of bm's pool is free or in exactly one live block (held or evictable) of one of the
    pool's members; each member's refs match its sequences' tables; cache entries name live blocks."""
    pool = bm.pool
    owner: dict[int, tuple] = {}
    for m in pool.members:
        refs = [0] * len(m.blocks)
        for seq in m.seqs.values():
            for b in seq.table[seq.num_dropped:]:
                refs[b] += 1
        for block in m.blocks:
            assert block.ref == refs[block.id], f"block {block.id}: ref {block.ref}, held {refs[block.id]} times"
            evictable = block.id in m._evictable
            assert not (block.ref and evictable), f"block {block.id} both held and evictable"
            if evictable:
                assert block.hash is not None
            if block.ref or evictable:
                assert len(m.pages(block.id)) == m.width
                for page in m.pages(block.id):
                    assert page not in owner, f"page {page} in two blocks: {owner[page]} and {block.id}"
                    owner[page] = (id(m), block.id)
            else:
                assert block.hash is None and block.id not in m._extra, f"dead block {block.id} keeps content"
        for h, b in m._cached.items():
            assert m.blocks[b].hash == h and (m.blocks[b].ref or b in m._evictable)
        assert m.num_used_blocks == sum(1 for r in refs if r)
    free = list(pool.free)
    assert len(set(free)) == len(free) and not set(free) & set(owner), "a page is free twice, or free and held"
    assert set(free) | set(owner) == set(range(pool.num_pages)), "a page leaked"
    assert bm.num_free_blocks == pool.available // bm.width


class Sim:
    """Drives the pool like the scheduler does, tracking what each sequence holds."""

    def __init__(self, num_blocks: int, window: int | None = None):
        self.bm, self.window = BlockManager(num_blocks, BS, window), window
        self.seqs: dict[int, dict] = {}  # id -> {"tokens": [...], "computed": n, "floor": n}
        self.next_id = 0
        self.kv = [[None] * BS for _ in range(num_blocks)]  # what the "cache" holds, per slot

    def write(self, sid: int, tokens: list[int], start: int) -> None:
        """What the model runner does: pending copies first, then the new tokens' K/V."""
        for src, dst in self.bm.take_copies():
            self.kv[dst] = list(self.kv[src])
        table = self.bm.table(sid)
        for pos in range(start, len(tokens)):
            self.kv[table[pos // BS]][pos % BS] = tokens[pos]

    def check_contents(self) -> None:
        for sid, s in self.seqs.items():
            table = self.bm.table(sid)
            # With a window: what the next query (at position `floor` or later) can see.
            first = 0 if self.window is None else max(0, s["floor"] - self.window + 1)
            seen = [self.kv[table[p // BS]][p % BS] for p in range(first, s["computed"])]
            assert seen == s["tokens"][first: s["computed"]], f"seq {sid} reads wrong K/V"

    def new(self, tokens: list[int]) -> None:
        sid, self.next_id = self.next_id, self.next_id + 1
        prefix = self.bm.match_prefix(sid, tokens, len(tokens) - 1)
        computed = len(prefix) * BS
        n = len(tokens) - computed
        if self.bm.allocate(sid, computed, n, prefix):
            self.write(sid, tokens, computed)
            self.bm.cache_full_blocks(sid, tokens, computed + n)
            self.seqs[sid] = {"tokens": list(tokens), "computed": computed + n, "floor": computed}
        else:
            self.bm.free(sid)  # match_prefix left hashes only

    def step(self, sid: int, token: int) -> None:
        s = self.seqs[sid]
        if self.bm.allocate(sid, s["computed"], 1):
            s["floor"] = s["computed"]  # a rolled-back draft goes back no further than this
            s["tokens"].append(token)
            self.write(sid, s["tokens"], s["computed"])
            s["computed"] += 1
            self.bm.cache_full_blocks(sid, s["tokens"], s["computed"])

    def fork(self, sid: int) -> None:
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(sid, child)
        self.seqs[child] = {**self.seqs[sid], "tokens": list(self.seqs[sid]["tokens"])}

    def truncate(self, sid: int, keep: int) -> None:
        s = self.seqs[sid]
        keep = max(1, min(keep, s["computed"]), s["floor"] if self.window else 0)
        self.bm.truncate(sid, keep)
        s["tokens"], s["computed"] = s["tokens"][:keep], keep

    def free(self, sid: int) -> None:
        self.bm.free(sid)
        del self.seqs[sid]


op = st.one_of(
    st.tuples(st.just("new"), st.lists(st.integers(0, 2), min_size=1, max_size=14)),
    st.tuples(st.just("step"), st.integers(0, 2)),
    st.tuples(st.just("fork"), st.integers(0, 0)),
    st.tuples(st.just("truncate"), st.integers(1, 12)),
    st.tuples(st.just("free"), st.integers(0, 0)),
)


@settings(max_examples=300, deadline=None)
@given(st.integers(4, 24), st.lists(st.tuples(op, st.integers(0, 1000)), max_size=60), st.sampled_from([None, 1, 5, 9]))
def test_random_operations_keep_the_pool_consistent(num_blocks, ops, window):
    sim = Sim(num_blocks, window)
    for (kind, arg), pick in ops:
        ids = sorted(sim.seqs)
        if kind == "new":
            sim.new(arg)
        elif ids:
            sid = ids[pick % len(ids)]
            getattr(sim, kind)(sid, arg) if kind in ("step", "truncate") else getattr(sim, kind)(sid)
        check_invariants(sim.bm)
        sim.check_contents()
        # Each sequence's table covers exactly its computed tokens.
        for sid, s in sim.seqs.items():
            assert len(sim.bm.table(sid)) == -(-s["computed"] // BS)
    for sid in list(sim.seqs):
        sim.free(sid)
    check_invariants(sim.bm)
    assert sim.bm.num_free_blocks == num_blocks and not sim.bm.seqs


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10_000), st.integers(8, 24))
def test_recently_used_prefix_survives_eviction_of_others(seed, num_blocks):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, BS)
    # Fill the cache with other prompts' blocks, then use prompt P last.
    for i in range(rng.randint(1, 6)):
        toks = [100 + i] + [rng.randint(0, 50) for _ in range(rng.randint(4, 16))]
        if bm.allocate(("other", i), 0, len(toks)):
            bm.cache_full_blocks(("other", i), toks, len(toks))
            bm.free(("other", i))
    prompt = [7] * (BS * 3) + [8]
    assert bm.allocate("p", 0, len(prompt))
    bm.cache_full_blocks("p", prompt, len(prompt))
    bm.free("p")
    # New, unrelated work that needs every block except P's three.
    held = []
    for i in range(num_blocks - 3):
        toks = [200 + i] * BS
        assert bm.allocate(("new", i), 0, BS)
        bm.cache_full_blocks(("new", i), toks, BS)
        held.append(("new", i))
    assert len(bm.match_prefix("q", prompt, len(prompt) - 1)) == 3
    # One more block evicts P's least useful block first: its last.
    for sid in held:
        bm.free(sid)
    check_invariants(bm)


def test_prefix_hit_shares_blocks_and_copy_on_write_after_fork():
    bm = BlockManager(16, BS)
    a = list(range(10))  # 2 full blocks + 2 tokens
    assert bm.allocate("a", 0, len(a))
    bm.cache_full_blocks("a", a, len(a))
    hits = bm.match_prefix("b", a + [99], len(a))
    assert hits == bm.table("a")[:2]
    assert bm.allocate("b", 8, 3, hits)
    assert bm.table("b")[:2] == bm.table("a")[:2] and bm.table("b")[2] != bm.table("a")[2]
    # Fork: the child shares the partial last block; its first write copies it.
    bm.fork("a", "c")
    shared = bm.table("a")[2]
    assert bm.allocate("c", 10, 1)
    assert bm.table("c")[2] != shared and bm.take_copies() == [(shared, bm.table("c")[2])]
    assert bm.allocate("a", 10, 1) and bm.table("a")[2] == shared and bm.take_copies() == []
    for s in ("a", "b", "c"):
        bm.free(s)
    check_invariants(bm)
    assert bm.num_free_blocks == 16


def test_salted_chains_share_only_among_themselves():
    """A salt roots a sequence's chain (LongRoPE: long prompts' keys are rotated otherwise): the
    same tokens under another salt find nothing, under the same salt everything; forks keep it."""
    bm = BlockManager(16, BS)
    a = list(range(9))  # 2 full blocks
    assert bm.allocate("long", 0, len(a), salt=1)
    bm.cache_full_blocks("long", a, len(a))
    assert bm.match_prefix("short", a, 8) == []
    assert bm.match_prefix("long2", a, 8, salt=1) == bm.table("long")[:2]
    assert bm.allocate("short", 0, len(a))  # its own blocks, cached under no salt beside the salted ones
    bm.cache_full_blocks("short", a, len(a))
    assert bm.match_prefix("short2", a, 8) == bm.table("short")[:2] != bm.table("long")[:2]
    bm.fork("long", "child")
    assert bm.seqs["child"].salt == 1
    for seq in ("long", "long2", "short", "short2", "child"):
        bm.free(seq)
    check_invariants(bm)


def test_allocation_fails_cleanly_when_short():
    bm = BlockManager(3, BS)
    assert bm.allocate("a", 0, 8)
    assert not bm.allocate("b", 0, 8)
    assert "b" not in bm.seqs or not bm.table("b")
    check_invariants(bm)
    assert bm.num_free_blocks == 1


def test_rewritten_cached_block_is_forgotten():
    bm = BlockManager(8, BS)
    toks = list(range(8))
    assert bm.allocate("a", 0, 8)
    bm.cache_full_blocks("a", toks, 8)
    bm.truncate("a", 6)  # block 1 still holds the cached tokens until position 6 is rewritten
    assert len(bm.match_prefix("x", toks + [1], 8)) == 2
    assert bm.allocate("a", 6, 1)  # now it is rewritten: no longer a valid cache entry
    assert len(bm.match_prefix("y", toks + [1], 8)) == 1
    bm.free("a")
    check_invariants(bm)


class SplitSim:
    """Drives a SplitBlockManager like the scheduler does. Each page holds, per slot, the token its
    block's kind wrote there ("full" or "window", one write to each of a block's pages), so a page
    that two blocks share, or one that changes hands while a table still reads it, shows up."""

    def __init__(self, num_pages: int, window: int, widths: tuple[int, int]):
        self.bm, self.window = SplitBlockManager(num_pages, BS, window, widths), window
        self.seqs: dict[int, dict] = {}
        self.next_id = 0
        self.kv = [[None] * BS for _ in range(num_pages)]

    def kinds(self):
        return (("full", self.bm.full, self.bm.table), ("window", self.bm.window, self.bm.window_table))

    def write(self, sid: int, tokens: list[int], start: int) -> None:
        for src, dst in self.bm.take_copies():
            self.kv[dst] = list(self.kv[src])
        for kind, m, table in self.kinds():
            for pos in range(start, len(tokens)):
                for page in m.pages(table(sid)[pos // BS]):
                    self.kv[page][pos % BS] = (kind, tokens[pos])

    def check_contents(self) -> None:
        for sid, s in self.seqs.items():
            for kind, m, table in self.kinds():
                first = 0 if kind == "full" else max(0, s["floor"] - self.window + 1)
                want = [(kind, t) for t in s["tokens"][first: s["computed"]]]
                for page_of in range(m.width):
                    seen = [self.kv[m.pages(table(sid)[p // BS])[page_of]][p % BS] for p in range(first, s["computed"])]
                    assert seen == want, f"seq {sid} reads wrong {kind} K/V"

    new, step, truncate, free = Sim.new, Sim.step, Sim.truncate, Sim.free



@settings(max_examples=300, deadline=None)
@given(st.integers(6, 40), st.lists(st.tuples(op, st.integers(0, 1000)), max_size=60), st.sampled_from([1, 5, 9]),
       st.sampled_from([(1, 1), (1, 3), (2, 3)]))
def test_random_operations_keep_a_shared_page_pool_consistent(num_pages, ops, window, widths):
    """The split manager's two kinds of blocks over one pool of pages (SplitKVCache): no page leaked,
    shared or read after it changed hands; both kinds' tables cover the computed tokens."""
    if num_pages < sum(widths):
        return
    sim = SplitSim(num_pages, window, widths)
    for (kind, arg), pick in ops:
        ids = sorted(sim.seqs)
        if kind == "new":
            sim.new(arg)
        elif ids and kind != "fork":  # (no fork in a split cache)
            sid = ids[pick % len(ids)]
            getattr(sim, kind)(sid, arg) if kind in ("step", "truncate") else getattr(sim, kind)(sid)
        check_invariants(sim.bm.full)
        sim.check_contents()
        for sid, s in sim.seqs.items():
            assert len(sim.bm.table(sid)) == len(sim.bm.window_table(sid)) == -(-s["computed"] // BS)
    for sid in list(sim.seqs):
        sim.free(sid)
    check_invariants(sim.bm.full)
    assert sim.bm.pool.available == num_pages and not sim.bm.full.seqs and not sim.bm.window.seqs


def test_pages_the_window_gives_back_serve_the_full_layers():
    """One long sequence: behind its window the sliding blocks' pages go back to the pool, so the
    full layers' table grows past what two fixed halves of the pool would hold."""
    bm = SplitBlockManager(24, BS, window=4, widths=(1, 3))
    tokens = list(range(60))
    assert bm.allocate("a", 0, 8)
    for n in range(8, 60):
        assert bm.allocate("a", n, 1), f"short at {n} tokens"
        bm.cache_full_blocks("a", tokens[: n + 1], n + 1)
    # 15 full blocks (60 tokens) + the window's last 2-3 blocks of 3 pages: 24 pages.
    assert len(bm.table("a")) == 15 and bm.window_pages_used <= 9
    assert not bm.allocate("b", 0, 8)  # nothing left for a second sequence of two blocks
    assert bm.can_allocate("b", 0, 0) and bm.num_free_blocks == 0
    bm.free("a")
    check_invariants(bm.full)
    # Now a prefix: the full blocks and the last window are still cached (evictable).
    hits = bm.match_prefix("c", tokens + [0], 60)
    assert len(hits) == 15
    assert bm.allocate("c", 60, 1, hits)
    check_invariants(bm.full)
