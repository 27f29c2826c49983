"""The vLLM connector's parts without vLLM (``aidaptiv_ds.inference.vllm``): the extra config, the paged
layouts of the CPU and GPU backends (the GPU path on CPU tensors of its layout), the scheduler's planning
and the worker's store thread (saves written behind, loads, a restart, a corrupt block, a full save buffer).
The server itself is tested by tests/test_vllm_serve.py (marker ``vllm``)."""
from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from aidaptiv_ds.errors import AidaptivConfigError
from aidaptiv_ds.inference.fingerprint import Fingerprint
from aidaptiv_ds.inference.layout import KVLayout
from aidaptiv_ds.inference.vllm import config as vconfig
from aidaptiv_ds.inference.vllm.identity import key_scheme, model_files_digest
from aidaptiv_ds.inference.vllm.paged import INTERLEAVED, SPLIT, PagedKV, UnsupportedKVCacheError, family
from aidaptiv_ds.inference.vllm.planner import Planner, read_index
from aidaptiv_ds.inference.vllm.worker import BlockMover, LoadChunk, SaveChunk


def test_the_package_imports_without_vllm():
    import aidaptiv_ds.inference.vllm as pkg

    assert "vllm" not in sys.modules or sys.modules["vllm"] is not None
    with pytest.raises(AttributeError):
        pkg.NoSuchThing  # noqa: B018


# ---------------------------------------------------------------------------------------------- config
def test_extra_config_is_checked_naming_key_value_and_fix(tmp_path):
    ok = vconfig.parse({"cache_paths": [str(tmp_path)], "capacity": "1GiB", "dram_budget": 0})
    assert ok.cache_paths == (str(tmp_path),) and ok.capacity == 1 << 30 and ok.dram_budget == 0
    assert ok.chunk_tokens(128) == 128 and ok.chunk_tokens(16) == 128 and ok.chunk_tokens(48) == 144
    cases = [({}, r"cache_paths: missing.*Fix"),
             ({"cache_paths": [str(tmp_path / "nope")]}, r"cache_paths: '.*nope' does not exist.*Fix: create it"),
             ({"cache_paths": [str(tmp_path)], "capacity": "lots"}, r"capacity.*'lots'.*Fix"),
             ({"cache_paths": [str(tmp_path)], "dram_budget": -1}, r"dram_budget.*-1.*Fix"),
             ({"cache_paths": [str(tmp_path)], "block_tokens": 0}, r"block_tokens: 0 is not a whole number.*Fix"),
             ({"cache_paths": [str(tmp_path)], "on_mismatch": "maybe"}, r"on_mismatch: 'maybe'.*Fix: give error or ignore"),
             ({"cache_paths": [str(tmp_path)], "direct": "yes"}, r"direct: 'yes' is not true or false"),
             ({"cache_paths": [str(tmp_path)], "cache_path": "x"}, r"unknown key\(s\) 'cache_path'.*Fix: use only"),
             ({"cache_paths": [str(tmp_path), str(tmp_path)]}, r"names a directory twice")]
    for extra, pattern in cases:
        with pytest.raises(AidaptivConfigError, match=pattern):
            vconfig.parse(extra)
    with pytest.raises(AidaptivConfigError, match=r"block_tokens: 100 is not a multiple of vLLM's block size 16.*Fix"):
        vconfig.parse({"cache_paths": [str(tmp_path)], "block_tokens": 100}).chunk_tokens(16)


def test_random_block_hash_seeds_are_refused(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(AidaptivConfigError, match="xxhash.*Fix: use sha256"):
        key_scheme("xxhash", 16)
    assert key_scheme("sha256", 16)[0] != key_scheme("sha256", 128)[0]
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert key_scheme("xxhash", 16)[0] != key_scheme("sha256", 16)[0]


def test_model_files_digest_sees_a_changed_weight(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8, "transformers_version": "1"}')
    w = tmp_path / "model.safetensors"
    w.write_bytes(bytes(range(256)) * 4096)
    a = model_files_digest(str(tmp_path))
    (tmp_path / "config.json").write_text('{"hidden_size": 8, "transformers_version": "2"}')  # bookkeeping only
    assert model_files_digest(str(tmp_path)) == a
    data = bytearray(w.read_bytes())
    data[-10] ^= 1  # the last sample reads the file's end
    w.write_bytes(bytes(data))
    assert model_files_digest(str(tmp_path)) != a


# ---------------------------------------------------------------------------------------------- paged layouts
L, B, H, N, D = 3, 10, 2, 4, 8


def cpu_caches():
    """CPU_ATTN: [B, H, N, 2D] contiguous (LBHNC); per head the N key rows, then the N value rows."""
    return [torch.randn(B, H, N, 2 * D).bfloat16() for _ in range(L)]


def nhd_caches():
    """FLASH_ATTN with the NHD layout (LBNHC): physical [B, N, H, 2D], handed over as the [B, H, N, 2D] view."""
    return [torch.randn(B, N, H, 2 * D, dtype=torch.float16).permute(0, 2, 1, 3) for _ in range(L)]


def keys_values(cache, kind, b):
    if kind == SPLIT:
        kv = cache.reshape(B, H, 2 * N, D)[b]
        return kv[:, :N], kv[:, N:]
    return cache[b, :, :, :D], cache[b, :, :, D:]


@pytest.mark.parametrize("kind,make", [(SPLIT, cpu_caches), (INTERLEAVED, nhd_caches)], ids=["cpu_split", "gpu_nhd"])
@pytest.mark.parametrize("batched", [False, True], ids=["per_block", "batched_gpu_path"])
def test_gather_writes_the_canonical_order_and_scatter_restores_it(kind, make, batched):
    caches = make()
    p = PagedKV(caches, kind)
    assert (p.kv_heads, p.block_size, p.head_dim, p.layers) == (H, N, D, L)
    blocks = [7, 2, 5]
    buf = torch.zeros(p.block_nbytes * 3 + 4096, dtype=torch.uint8)
    assert p.gather(blocks, buf, batched=batched) is None
    lay = KVLayout(L, H, D, "bfloat16" if kind == SPLIT else "float16", 3 * N)
    for layer, (k, v) in enumerate(lay.views(buf)):  # [H, T, D] per layer, T = 3 vLLM blocks
        for j, b in enumerate(blocks):
            ck, cv = keys_values(caches[layer], kind, b)
            assert torch.equal(k[:, j * N:(j + 1) * N], ck) and torch.equal(v[:, j * N:(j + 1) * N], cv)
    fresh = [torch.zeros_like(c) for c in caches] if kind == SPLIT else \
        [torch.zeros(B, N, H, 2 * D, dtype=torch.float16).permute(0, 2, 1, 3) for _ in range(L)]
    q = PagedKV(fresh, kind)
    q.scatter([1, 9], buf, first=1, batched=batched)  # the last two of the three, as a load past a local prefix
    for layer in range(L):
        for dst, src in ((1, 2), (9, 5)):
            assert torch.equal(keys_values(fresh[layer], kind, dst)[0], keys_values(caches[layer], kind, src)[0])
            assert torch.equal(keys_values(fresh[layer], kind, dst)[1], keys_values(caches[layer], kind, src)[1])
        assert not fresh[layer][0].any() and not fresh[layer][7].any()  # nothing else written


def test_unsupported_caches_are_refused():
    with pytest.raises(UnsupportedKVCacheError, match="FLASHMLA is not supported.*Fix"):
        family("FLASHMLA")
    with pytest.raises(UnsupportedKVCacheError, match="dtype torch.uint8.*kv-cache-dtype auto"):
        PagedKV([torch.zeros(B, H, N, 2 * D, dtype=torch.uint8)], SPLIT)
    with pytest.raises(UnsupportedKVCacheError, match="hybrid"):
        PagedKV([torch.zeros(B, H, N, 2 * D), torch.zeros(B, H, 2 * N, 2 * D)], SPLIT)
    with pytest.raises(UnsupportedKVCacheError, match="each head's block contiguous"):
        PagedKV(nhd_caches(), SPLIT)


# ---------------------------------------------------------------------------------------------- planner
class Req:
    def __init__(self, rid, tokens, bs=4):
        self.request_id = rid
        self.tokens = list(tokens)
        self.num_tokens = len(self.tokens)
        self.num_computed_tokens = 0
        self.block_hashes = []
        h = b""
        for i in range(len(self.tokens) // bs):  # a chain like vLLM's: each hash covers every token before
            import hashlib
            h = hashlib.sha256(h + bytes(str(self.tokens[i * bs:(i + 1) * bs]), "ascii")).digest()
            self.block_hashes.append(h)


def test_planner_saves_each_block_once_and_loads_the_stored_chain():
    pl = Planner(chunk_tokens=8, block_size=4, hash_block_size=4, index={})
    shared = list(range(100, 124))  # three stored blocks of 8 tokens
    a, b = Req("a", shared + [1, 2, 3]), Req("b", shared + [4, 5, 6, 7, 8])
    for r in (a, b):
        pl.add(r)
        assert pl.match(r, 0) == (0, False)
    plan = pl.plan([("a", list(range(10, 17)), True), ("b", list(range(20, 28)), True)], {"a": 27, "b": 29}, set())
    saves = plan.saves
    assert [len(s) for s in saves] == [3]  # b shares a's three blocks: planned once
    assert [c.block_ids for c in saves[0]] == [[10, 11], [12, 13], [14, 15]]
    assert saves[0][1].parent == saves[0][0].key and saves[0][0].parent is None
    pl.on_events([(c.key, c.parent, c.depth) for c in saves[0]], [], [])
    assert not pl.pending
    c = Req("c", shared + [9, 9])  # a later request (a restarted server: the same index)
    pl.add(c)
    assert pl.match(c, 0) == (24, True)
    assert pl.match(c, 8) == (16, True)  # vLLM has the first block locally: only the rest is loaded
    pl.after_alloc(c, [40, 41, 42, 43, 44, 45, 46], 16)
    loads = pl.plan([("c", None, False)], {}, set()).loads
    assert loads == [("c", [LoadChunk(saves[0][1].key, 0, [42, 43]), LoadChunk(saves[0][2].key, 0, [44, 45])])]
    pl.on_events([], [saves[0][1].key], [])  # evicted: the chain now ends after block 0
    d = Req("d", shared + [1])
    pl.add(d)
    assert pl.match(d, 0) == (8, True)
    e = Req("e", shared[:16])  # a prompt of exactly two blocks: its last token is computed, so one block loads
    pl.add(e)
    assert pl.match(e, 0) == (8, True)


def test_planner_reads_the_index_file(tmp_path):
    os.makedirs(tmp_path / "x")
    assert read_index([str(tmp_path / "x")]) == {}


# ---------------------------------------------------------------------------------------------- worker
def mover(path, caches, kind=SPLIT, **kw):
    p = PagedKV(caches, kind)
    cfg = vconfig.parse({"cache_paths": [str(path)], "capacity": "64MiB", "dram_budget": kw.pop("dram", 0), **kw})
    lay = KVLayout(p.layers, p.kv_heads, p.head_dim, "bfloat16", 2 * N, "vllm-cpu_attn/test/4")
    return BlockMover(cfg, Fingerprint("m", "bfloat16", "vllm-keys"), lay, p)


def wait_events(m, n):
    import time

    got = types.SimpleNamespace(stored=[], removed=[], skipped=[])
    t0 = time.time()
    while len(got.stored) + len(got.skipped) < n and time.time() - t0 < 60:
        ev = m.take_events()
        got.stored += ev.stored
        got.removed += ev.removed
        got.skipped += ev.skipped
        time.sleep(0.01)
    return got


def poll_until(m, t=60):
    import time

    t0 = time.time()
    while time.time() - t0 < t:
        done, failed = m.poll()
        if done:
            return done, failed
        time.sleep(0.01)
    raise AssertionError("load not reported")


def test_saves_are_written_behind_once_and_load_after_a_restart(tmp_path):
    caches = cpu_caches()
    m = mover(tmp_path, caches)
    assert m.take_events().snapshot == {}
    chunks = [SaveChunk("k0", None, 0, [3, 4]), SaveChunk("k1", "k0", 1, [5, 6])]
    assert m.save(chunks) == 2
    ev = wait_events(m, 2)
    assert sorted(ev.stored) == [("k0", None, 0), ("k1", "k0", 1)]
    m.save([SaveChunk("k1", "k0", 1, [5, 6])])  # already stored: not written again
    wait_events(m, 1)
    written = m.store.stats().blocks_written
    m.close()
    assert written == 2
    fresh = [torch.zeros_like(c) for c in caches]
    m2 = mover(tmp_path, fresh)  # a restart: the same directory
    assert m2.take_events().snapshot == {"k0": (None, 0), "k1": ("k0", 1)}
    m2.load("r1", [LoadChunk("k0", 1, [8]), LoadChunk("k1", 0, [0, 1])])
    done, failed = poll_until(m2)
    assert done == {"r1"} and failed == set()
    for c, f in zip(caches, fresh):
        assert torch.equal(f[8], c[4]) and torch.equal(f[0], c[5]) and torch.equal(f[1], c[6])
    st = m2.store.stats()
    assert st.blocks_from_drive == 2 and st.blocks_written == 0
    m2.close()


def test_a_corrupt_block_is_never_copied_and_is_reported(tmp_path):
    caches = cpu_caches()
    m = mover(tmp_path, caches)
    m.save([SaveChunk("k0", None, 0, [3, 4]), SaveChunk("k1", "k0", 1, [5, 6])])
    wait_events(m, 2)
    runs = m.store.store.physical_runs("kv/k1", 0, 64)  # inside the payload (1,536 bytes)
    slab = m.store.ns.slab_path(0)
    m.close()
    with open(slab, "r+b") as f:
        f.seek(runs[0][1])
        f.write(os.urandom(64))
    fresh = [torch.zeros_like(c) for c in caches]
    m2 = mover(tmp_path, fresh)
    m2.load("r", [LoadChunk("k0", 0, [0, 1]), LoadChunk("k1", 0, [2, 3])])
    done, failed = poll_until(m2)  # the store thread warns (KVCacheWarning) and drops the block
    assert done == {"r"} and failed == {2, 3} and m2.store.stats().blocks_corrupt == 1
    assert not any(f[2].any() or f[3].any() for f in fresh)  # the bad block's bytes never reached the cache
    assert all(torch.equal(f[0], c[3]) for f, c in zip(fresh, caches))
    assert "k1" in m2.take_events().removed and "k1" not in m2.known()  # the scheduler forgets it
    m2.load("r2", [LoadChunk("gone", 0, [5])])  # a block evicted after the scheduler planned it
    assert poll_until(m2) == ({"r2"}, {5})
    m2.close()


def test_a_full_save_buffer_skips_instead_of_waiting(tmp_path):
    m = mover(tmp_path, cpu_caches(), save_buffer=100)  # smaller than one block (4 KiB): nothing fits
    assert m.save([SaveChunk("k0", None, 0, [1, 2])]) == 0
    assert m.take_events().skipped == ["k0"] and m.stats["saves_skipped"] == 1
    m.close()
