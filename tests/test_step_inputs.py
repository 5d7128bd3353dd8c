"""The model runner's step inputs (built with numpy over preallocated arrays) against plain
per-token loops: the eager path's attention metadata against AttentionMetadata.build, and the
graph path's padded buffers (ids, positions, slots, lengths, block tables kept across steps,
logit rows) against a direct construction, over random steps whose tables grow, get replaced
(copy-on-write, truncate) and move between batch rows."""
from __future__ import annotations

import random

import torch

from fitllm.models.config import ModelConfig
from fitllm.models.decoder import CausalLM
from fitllm.models.kv_cache import AttentionMetadata
from fitllm.serve.block_manager import BlockManager
from fitllm.serve.model_runner import ModelRunner, StepSeq

BS, MAX_LEN, MAX_SEQS = 4, 64, 8


def stub_runner():
    """A runner over a one-layer model whose forward records its inputs instead of computing."""
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=16, intermediate_size=32,
                         num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=MAX_LEN)
    model = CausalLM(config).eval()
    seen = []

    def forward(ids, pos, ctx):
        seen.append((ids.clone(), pos.clone(), ctx.meta))
        return torch.arange(len(ids), dtype=torch.float32)[:, None].repeat(1, 16)  # row i holds i

    model.forward = forward
    runner = ModelRunner(model, BS)
    runner.allocate_cache(200, MAX_LEN)
    return runner, seen


def random_step(rng: random.Random, max_q: int) -> list[StepSeq]:
    seqs = []
    for _ in range(rng.randint(1, MAX_SEQS)):
        n = rng.randint(1, max_q)
        start = rng.randint(0, MAX_LEN - n)
        table = rng.sample(range(200), -(-(start + n) // BS))
        seqs.append(StepSeq([rng.randrange(32) for _ in range(n)], start, table, rng.randint(0, n)))
    return seqs


def test_eager_inputs_equal_the_per_token_build():
    runner, seen = stub_runner()
    rng = random.Random(0)
    for _ in range(30):
        seqs = random_step(rng, 9)
        logits_rows = runner._run_eager(seqs)[1]
        ids, pos, meta = seen[-1]
        ref = AttentionMetadata.build([len(s.token_ids) for s in seqs], [s.start + len(s.token_ids) for s in seqs],
                                      [s.block_table for s in seqs], BS, "cpu")
        assert ids.tolist() == [t for s in seqs for t in s.token_ids]
        assert pos.tolist() == [p for s in seqs for p in range(s.start, s.start + len(s.token_ids))]
        for name in ("slot_mapping", "query_start", "seq_lens"):
            got, want = getattr(meta, name), getattr(ref, name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
        # tables: the reference's columns, then zeros up to a width that is a multiple of 16
        got, want = meta.block_tables, ref.block_tables
        assert got.dtype == want.dtype and got.shape[1] % 16 == 0 and got.shape[1] - want.shape[1] < 16
        assert torch.equal(got[:, :want.shape[1]], want) and not got[:, want.shape[1]:].any()
        for name in ("query_start_list", "seq_lens_list", "max_query_len"):
            assert getattr(meta, name) == getattr(ref, name), name
        assert meta.max_seq_len == MAX_LEN  # the bound the decode kernel is sized by, not this step's longest
        flat, end = [], 0
        for s in seqs:
            end += len(s.token_ids)
            flat += range(end - s.num_logits, end)
        assert torch.arange(end)[logits_rows].tolist() == flat


def reference_graph_inputs(seqs: list[StepSeq], q: int, size: int, width: int, scratch: int):
    slot_of_scratch = scratch * BS
    ids, pos, slots, rows, tables = [], [], [], [], []
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        ids += s.token_ids + [0] * (q - n)
        pos += range(s.start, s.start + q)
        slots += [s.block_table[p // BS] * BS + p % BS for p in range(s.start, s.start + n)]
        slots += [slot_of_scratch] * (q - n)
        rows += range(i * q + n - s.num_logits, i * q + n)
        tables.append(s.block_table + [scratch] * (width - len(s.block_table)))
    pad = size - len(seqs)
    ids += [0] * q * pad
    pos += list(range(q)) * pad
    slots += [slot_of_scratch] * q * pad
    seq_lens = [s.start + q for s in seqs] + [q] * pad
    tables += [[scratch] * width] * pad
    return ids, pos, slots, rows, seq_lens, tables


def test_graph_inputs_equal_a_direct_build_across_steps():
    runner, _ = stub_runner()
    assert runner.capture_graphs(MAX_SEQS, emulate_on_cpu=True, query_lens=(1, 3))
    graphs = runner.graphs
    graphs.replays = {key: (lambda: None) for key in graphs.replays}  # inputs only
    rng = random.Random(1)
    bm = BlockManager(200, BS)
    lens: dict[int, int] = {}
    for step in range(60):
        # Sequences come and go, grow (tables extended in place), get truncated or copied (new lists).
        for sid in list(lens):
            if rng.random() < 0.1:
                bm.free(sid)
                del lens[sid]
        while len(lens) < rng.randint(1, MAX_SEQS):
            sid = step * 100 + len(lens)
            if rng.random() < 0.2 and lens:
                parent = rng.choice(list(lens))
                bm.fork(parent, sid)  # shares the last block: the next write copies it
                lens[sid] = lens[parent]
            else:
                lens[sid] = rng.randint(0, 20)
                assert bm.allocate(sid, 0, max(1, lens[sid]))
        seqs = []
        order = list(lens)
        if rng.random() < 0.3:
            rng.shuffle(order)  # rows move: a row's cached table must not be reused for another list
        for sid in order:
            if rng.random() < 0.15 and lens[sid] > 2:
                lens[sid] -= 2
                bm.truncate(sid, lens[sid])
            n = rng.choice((1, 1, 2, 3))
            if lens[sid] + n > MAX_LEN - 1:
                continue
            assert bm.allocate(sid, lens[sid], n)
            seqs.append(StepSeq([rng.randrange(32) for _ in range(n)], lens[sid], bm.table(sid), rng.randint(0, n)))
            lens[sid] += n
        if not seqs or not graphs.fits(seqs):
            continue
        q, size = graphs._shape(seqs)
        _, rows = graphs.run(seqs)
        t = q * size
        ids, pos, slots, want_rows, seq_lens, tables = reference_graph_inputs(
            seqs, q, size, graphs.width, graphs.scratch_block)
        longs, ints = graphs.longs, graphs.ints
        assert longs[:t].tolist() == ids and longs[t:2 * t].tolist() == pos and longs[2 * t:3 * t].tolist() == slots
        assert rows.tolist() == want_rows
        assert ints[:size].tolist() == seq_lens
        assert ints[size: size * (1 + graphs.width)].view(size, -1).tolist() == tables, f"step {step}"


def test_a_table_list_only_grows_in_place():
    """What the graph path's incremental tables rely on: copy-on-write and truncate replace the list."""
    bm = BlockManager(16, BS)
    assert bm.allocate("a", 0, 6)
    table = bm.table("a")
    assert bm.allocate("a", 6, 4) and bm.table("a") is table and len(table) == 3
    bm.truncate("a", 5)
    assert bm.table("a") is not table and len(bm.table("a")) == 2
    table = bm.table("a")
    bm.fork("a", "b")
    assert bm.allocate("b", 5, 1)  # writes into the shared second block: a private copy
    assert bm.take_copies() and bm.table("b") is not table and bm.table("a") is table
