"""The prefix KV cache (``aidaptiv_ds.inference``): greedy output identical to plain ``generate``, reuse from
DRAM and from the drive after a reopen, budgets and eviction, ledger, checksums, fingerprints, crashes."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from _oracle import REPO, SHARED, STORIES, STORIES_ABSENT

from aidaptiv_ds.inference import KVCacheMismatchError, KVCacheWarning, KVLayout, PrefixKVCache
from aidaptiv_ds.inference.block_store import KVBlockStore, namespace
from aidaptiv_ds.inference.hashing import block_hashes, chain_root
from aidaptiv_ds.store.layout import StoreInUseError

needs_stories = pytest.mark.skipif(not os.path.isdir(STORIES), reason=f"real model not found at {STORIES}")
B = 16  # tokens per block in these tests


@pytest.fixture(scope="module")
def stories():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(STORIES):
        pytest.skip(STORIES_ABSENT)
    tok = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    return model, tok


def prompts(n_ctx=150, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(3, 512, (n_ctx,), generator=g).tolist()
    return ctx, [ctx + torch.randint(3, 512, (5 + i,), generator=g).tolist() for i in range(n)]


def plain(model, ids, new=12):
    x = torch.tensor([ids])
    with torch.no_grad():
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False)


def open_cache(path, model, tok, **kw):
    kw.setdefault("block_tokens", B)
    kw.setdefault("capacity", "64MiB")
    return PrefixKVCache(str(path), model, tok, **kw)


# ---------------------------------------------------------------------------------------------- units
def test_block_hash_chain_keys_the_whole_prefix():
    root = chain_root("fp", 4)
    a = block_hashes(list(range(10)), 4, root)
    assert len(a) == 2  # the partial third block has no key
    b = block_hashes(list(range(8)) + [99, 98, 97], 4, root)
    assert a == b[:2]
    c = block_hashes([0, 1, 2, 3, 4, 5, 6, 7 + 1, 8], 4, root)  # differs in block 1
    assert c[0] == a[0] and c[1] != a[1]
    d = block_hashes([5, 1, 2, 3, 4, 5, 6, 7], 4, root)  # differs in block 0: every later key differs
    assert d[0] != a[0] and d[1] != a[1]
    assert block_hashes(list(range(8)), 4, chain_root("other", 4)) != a  # another fingerprint, other keys


def test_layout_pack_and_views_round_trip():
    lay = KVLayout(layers=3, kv_heads=2, head_dim=4, dtype="float32", block_tokens=5)
    assert lay.block_nbytes == 3 * 2 * 2 * 5 * 4 * 4
    kv = [(torch.randn(1, 2, 12, 4), torch.randn(1, 2, 12, 4)) for _ in range(3)]
    buf = torch.zeros(lay.block_nbytes + 100, dtype=torch.uint8)
    lay.pack(buf, kv, 5)
    for (k, v), (bk, bv) in zip(kv, lay.views(buf)):
        assert torch.equal(bk, k[0, :, 5:10]) and torch.equal(bv, v[0, :, 5:10])
    with pytest.raises(ValueError, match="do not hold tokens"):
        lay.pack(buf, kv, 10)  # tokens 10..15 of a 12-token cache
    with pytest.raises(ValueError, match="bfloat16"):
        lay.pack(buf, [(k.bfloat16(), v.bfloat16()) for k, v in kv], 0)


def test_fingerprint_samples_every_tensor_up_to_its_last_element():
    """The sample positions of a 49152 x 576 embedding (fp32 linspace would round past its end)."""
    from aidaptiv_ds.inference.fingerprint import _sample, model_digest

    t = torch.zeros(49152 * 576)
    a = _sample(t)
    t[-1] = 1.0
    assert _sample(t) != a
    m = torch.nn.Linear(8, 8)
    d = model_digest(m)
    with torch.no_grad():
        m.weight[0, 0] += 1.0
    assert model_digest(m) != d


def test_sliding_window_models_are_refused():
    from transformers import MistralConfig

    cfg = MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                        intermediate_size=128, sliding_window=32)
    with pytest.raises(ValueError, match="sliding window of 32 tokens"):
        KVLayout.from_model_config(cfg, torch.float32, 16)


# ---------------------------------------------------------------------------------------------- HF generate
@needs_stories
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_output_identical_with_the_cache(stories, tmp_path, dtype):
    """Three questions on one 150-token context: the first computes, the next two reuse the context's 9
    full blocks (144 tokens) from DRAM; after a reopen the first loads them from the drive. Every output is
    token-identical to plain ``generate`` of the same model in the same dtype."""
    model, tok = stories
    # nn.Module.to converts in place: a copy, or the module's shared model stays bf16 for the later tests
    model = copy.deepcopy(model).to(dtype)
    _, ps = prompts()
    refs = [plain(model, p) for p in ps]
    with open_cache(tmp_path, model, tok) as kv:
        got = [kv.generate(model, p, max_new_tokens=12) for p in ps]
    assert [g.kv_source for g in got] == ["computed", "dram", "dram"]
    assert [g.prefix_tokens_reused for g in got] == [0, 144, 144]
    assert got[0].blocks_written == len(ps[0]) // B
    for r, g in zip(refs, got):
        assert torch.equal(r, g.sequences)
    with open_cache(tmp_path, model, tok) as kv:  # a new process sees the same directory
        again = kv.generate(model, ps[0], max_new_tokens=12)
        st = kv.stats()
    assert again.kv_source == "drive" and again.prefix_tokens_reused == (len(ps[0]) - 1) // B * B
    assert torch.equal(refs[0], again.sequences)
    assert st.blocks_from_drive == (len(ps[0]) - 1) // B and st.bytes_written == 0  # a hit writes nothing


@needs_stories
def test_a_prompt_of_whole_blocks_leaves_its_last_token_to_compute(stories, tmp_path):
    model, tok = stories
    ids = prompts(n_ctx=4 * B, n=1)[0]
    with open_cache(tmp_path, model, tok) as kv:
        first = kv.generate(model, ids, max_new_tokens=4)
        second = kv.generate(model, ids, max_new_tokens=4)
    assert first.blocks_written == 4 and second.prefix_tokens_reused == 3 * B and second.blocks_written == 0
    assert torch.equal(first.sequences, second.sequences)


@needs_stories
def test_batches_padding_and_foreign_caches_are_refused(stories, tmp_path):
    model, tok = stories
    with open_cache(tmp_path, model, tok) as kv:
        with pytest.raises(ValueError, match="one prompt at a time"):
            kv.generate(model, torch.ones(2, 8, dtype=torch.long))
        with pytest.raises(ValueError, match="padded prompts are not supported"):
            kv.generate(model, [5, 6, 7], attention_mask=torch.tensor([[0, 1, 1]]))
        with pytest.raises(ValueError, match="managed by the prefix cache"):
            kv.generate(model, [5, 6, 7], past_key_values=object())


# ---------------------------------------------------------------------------------------------- budgets
@needs_stories
def test_dram_budget_zero_keeps_nothing_in_dram(stories, tmp_path):
    model, tok = stories
    _, ps = prompts()
    with open_cache(tmp_path, model, tok, dram_budget=0) as kv:
        kv.generate(model, ps[0], max_new_tokens=4)
        hit = kv.generate(model, ps[1], max_new_tokens=4)
        assert hit.kv_source == "drive" and kv.stats().dram_bytes == 0


@needs_stories
def test_capacity_evicts_least_recently_used_leaves_first(stories, tmp_path):
    """Room for 12 blocks: two prompts with disjoint contexts of 9 and 9 blocks cannot both stay; the older
    one's tail goes first and the newest chain is whole; bytes of blocks never exceed the capacity."""
    model, tok = stories
    lay = KVLayout.from_model_config(model.config, torch.float32, B)
    ext = -(-lay.block_nbytes // 4096) * 4096
    a = prompts(n_ctx=150, n=1, seed=1)[1][0]
    b = prompts(n_ctx=150, n=1, seed=2)[1][0]
    with open_cache(tmp_path, model, tok, capacity=12 * ext) as kv:
        kv.generate(model, a, max_new_tokens=2)
        kv.generate(model, b, max_new_tokens=2)
        st = kv.stats()
        assert st.bytes_on_drive <= 12 * ext and st.blocks_evicted == len(a) // B + len(b) // B - 12
        hb = kv.lookup(b)
        ha = kv.lookup(a)
    assert hb.tokens == (len(b) - 1) // B * B  # the newest chain is complete
    assert ha.tokens == (12 - len(b) // B) * B  # what is left of the older one is its head


@needs_stories
def test_ledger_counts_the_blocks_written(stories, tmp_path):
    model, tok = stories
    _, ps = prompts()
    with open_cache(tmp_path, model, tok) as kv:
        kv.generate(model, ps[0], max_new_tokens=2)
        st = kv.stats()
        ns = kv.store.ns
    assert st.bytes_written >= st.blocks * kv.store.extent_bytes
    with open(os.path.join(ns.node_dir(0), "ledger.json")) as f:
        led = json.load(f)
    assert led["runs"]["prefix-kv"]["bytes_written"] >= st.bytes_written  # the close saved the index too


# ---------------------------------------------------------------------------------------------- bad input
def _corrupt_block(path, model, tok, depth):
    """Overwrite 64 bytes in the middle of block ``depth`` of the first prompt, on the drive."""
    with open_cache(path, model, tok) as kv:
        hashes = block_hashes(prompts()[1][0], B, kv.root)
        runs = kv.store.store.physical_runs("kv/" + hashes[depth], 4096, 64)
        slab = kv.store.ns.slab_path(0)
    with open(slab, "r+b") as f:
        f.seek(runs[0][1])
        f.write(os.urandom(64))


@needs_stories
def test_a_corrupt_block_fails_its_checksum_and_is_recomputed(stories, tmp_path):
    model, tok = stories
    _, ps = prompts()
    ref = plain(model, ps[0])
    with open_cache(tmp_path, model, tok) as kv:
        kv.generate(model, ps[0], max_new_tokens=12)
    _corrupt_block(tmp_path, model, tok, depth=5)
    with open_cache(tmp_path, model, tok) as kv:
        with pytest.warns(KVCacheWarning, match="checksum mismatch"):
            got = kv.generate(model, ps[0], max_new_tokens=12)
        st = kv.stats()
    assert torch.equal(ref, got.sequences)
    assert got.kv_source == "drive" and got.prefix_tokens_reused == 5 * B  # up to the bad block, not past it
    assert st.blocks_corrupt == 1 and got.blocks_written == len(ps[0]) // B - 5  # the rest recomputed and stored
    with open_cache(tmp_path, model, tok) as kv, warnings.catch_warnings():
        warnings.simplefilter("error", KVCacheWarning)
        again = kv.generate(model, ps[0], max_new_tokens=12)
    assert again.prefix_tokens_reused == (len(ps[0]) - 1) // B * B and torch.equal(ref, again.sequences)


@needs_stories
def test_another_model_dtype_or_tokenizer_is_refused_and_nothing_is_touched(stories, tmp_path):
    from transformers import AutoTokenizer

    model, tok = stories
    with open_cache(tmp_path, model, tok) as kv:
        kv.generate(model, prompts()[1][0], max_new_tokens=2)
        rank_dir = kv.store.ns.rank_dir(0)
    before = {n: os.stat(os.path.join(rank_dir, n)).st_mtime_ns for n in os.listdir(rank_dir)}
    other = type(model)(model.config)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        other.model.layers[2].mlp.up_proj.weight.mul_(1.01)  # a fine-tune of one tensor
    with pytest.raises(KVCacheMismatchError, match=r"(?s)model: written for .*stories260K.*Fix: give this model its own"):
        open_cache(tmp_path, other, tok)
    with pytest.raises(KVCacheMismatchError, match="dtype: written as float32, this run uses bfloat16"):
        open_cache(tmp_path, model, tok, dtype=torch.bfloat16)
    gpt2 = os.path.join(SHARED, "data", "tokenizer", "gpt2")
    if os.path.isdir(gpt2):
        with pytest.raises(KVCacheMismatchError, match="tokenizer: written with"):
            open_cache(tmp_path, model, AutoTokenizer.from_pretrained(gpt2))
    with pytest.raises(KVCacheMismatchError, match="layout.block_tokens: written as 16, this run uses 32"):
        open_cache(tmp_path, model, tok, block_tokens=32)
    with pytest.warns(KVCacheWarning, match="is not used"):
        ignored = open_cache(tmp_path, other, tok, on_mismatch="ignore")
    out = ignored.generate(other, prompts()[1][0], max_new_tokens=2)
    ignored.close()
    assert not ignored.enabled and out.kv_source == "computed" and out.blocks_written == 0
    after = {n: os.stat(os.path.join(rank_dir, n)).st_mtime_ns for n in os.listdir(rank_dir)}
    assert after == before  # never opened, never written


@needs_stories
def test_a_second_process_cannot_open_a_live_cache(stories, tmp_path):
    model, tok = stories
    with open_cache(tmp_path, model, tok):
        with pytest.raises(StoreInUseError, match="in use by another process"):
            open_cache(tmp_path, model, tok)


CRASH = r"""
import os, sys, torch
sys.path.insert(0, {repo!r})
from transformers import AutoModelForCausalLM, AutoTokenizer
from aidaptiv_ds.inference import PrefixKVCache
tok = AutoTokenizer.from_pretrained({stories!r})
m = AutoModelForCausalLM.from_pretrained({stories!r}, dtype=torch.float32)
kv = PrefixKVCache({path!r}, m, tok, block_tokens={B}, capacity={cap})
kv.generate(m, {a}, max_new_tokens=2)          # durable
store = kv.store.store
real = store.save_index
def die():
    os._exit(9)                                # killed after the blocks were written, before any index
store.save_index = die
kv.generate(m, {b}, max_new_tokens=2)
"""


@needs_stories
@pytest.mark.subprocess
def test_a_process_killed_mid_commit_leaves_a_usable_cache(stories, tmp_path):
    """Kill the process after a commit's blocks were written but before its indexes were saved (the capacity
    forces evictions into that commit): the reopened cache serves the durable prompt and frees the rest."""
    model, tok = stories
    lay = KVLayout.from_model_config(model.config, torch.float32, B)
    ext = -(-lay.block_nbytes // 4096) * 4096
    a = prompts(n_ctx=150, n=1, seed=1)[1][0]
    b = prompts(n_ctx=150, n=1, seed=2)[1][0]
    code = CRASH.format(repo=REPO, stories=STORIES, path=str(tmp_path), B=B, cap=14 * ext, a=a, b=b)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 9, p.stderr[-2000:]
    ref_a, ref_b = plain(model, a), plain(model, b)
    with open_cache(tmp_path, model, tok, capacity=14 * ext) as kv, warnings.catch_warnings():
        warnings.simplefilter("error", KVCacheWarning)  # no block may fail its checksum
        st0 = kv.stats()
        ga = kv.generate(model, a, max_new_tokens=12)
        gb = kv.generate(model, b, max_new_tokens=12)
        extents = [k for k in kv.store.store.keys() if k.startswith("kv/")]
        assert len(extents) == kv.stats().blocks  # no orphan extent survives the reopen
    assert st0.blocks <= len(a) // B and ga.prefix_tokens_reused > 0  # what was on record before the kill
    assert torch.equal(ref_a, ga.sequences) and torch.equal(ref_b, gb.sequences)


def test_namespace_of_a_missing_directory_is_refused(tmp_path):
    from aidaptiv_ds.store.layout import CachePathError

    with pytest.raises(CachePathError, match="kv_cache_path: .* does not exist"):
        namespace(str(tmp_path / "nope"))


def test_block_store_refuses_a_bad_option(tmp_path):
    from aidaptiv_ds.inference.fingerprint import Fingerprint

    fp = Fingerprint("m", "float32", "t")
    lay = KVLayout(1, 1, 8, "float32", 4)
    with pytest.raises(ValueError, match="on_mismatch"):
        KVBlockStore(str(tmp_path), fp, lay, on_mismatch="maybe")
    with pytest.raises(ValueError, match="kv_cache capacity"):
        KVBlockStore(str(tmp_path), fp, lay, capacity="lots")
