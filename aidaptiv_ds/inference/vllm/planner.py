"""The scheduler side: which stored blocks a request can load, and which of its blocks to store.

vLLM's scheduler runs in another process than the worker that owns the store, so the planner keeps
its own index of the stored blocks: read from the store's block index at start, then kept current by
the worker's events (committed, removed, skipped) that come back with every step's output.

**Keys.** A stored block covers ``T`` tokens (``T`` a multiple of vLLM's block size ``N``; vLLM's
request carries one hash per ``N`` tokens, each chaining every token before it: ``hash_block_tokens``
in ``vllm/v1/core/kv_cache_utils.py``). Stored block ``i`` (tokens ``[i T, (i + 1) T)``) is keyed by
the hex of vLLM's hash of its last vLLM block, so a prefix stored by any request of any earlier
process is found, and two requests share block ``i`` only when every token before its end agrees.

**Lookup** (:meth:`Planner.match`): the chain of stored blocks from block 0, as long as each is in
the index and its recorded parent is the previous key, and never the prompt's last token (vLLM must
compute at least one). Loads are asynchronous: the request waits (``WAITING_FOR_REMOTE_KVS``) while
other requests run; a prefix vLLM already holds locally is not loaded again (only the vLLM blocks
past it).

**Saves** (:meth:`Planner.plan`): after each step, the stored blocks whose tokens all have their
keys and values computed (``min(computed + scheduled, num_tokens)``: the prompt, and generated
tokens whose KV exists, so a chat's next turn finds its history), not stored, not pending, and
whose parent is stored or pending. A block is planned once (``pending`` until the worker reports it
committed or skipped), so it is written once however many requests share it.
"""
from __future__ import annotations

import dataclasses
import json
import os

from ..block_store import BLOCKS, namespace
from .worker import LoadChunk, SaveChunk


@dataclasses.dataclass
class Plan:
    """One step's work for the worker: ``loads`` (request id, chunks) and ``saves`` (chunks)."""
    loads: list[tuple[str, list[LoadChunk]]] = dataclasses.field(default_factory=list)
    saves: list[list[SaveChunk]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Req:
    request: object
    block_ids: list[int] = dataclasses.field(default_factory=list)
    saved_upto: int = 0  # stored blocks below this index are stored, loaded or given up on
    local_tokens: int = 0  # tokens vLLM had locally when the load was planned


def read_index(cache_paths: list[str]) -> dict[str, tuple[str | None, int]]:
    """``{key: (parent, depth)}`` from the block index of the store under ``cache_paths`` (empty when none)."""
    p = os.path.join(namespace(list(cache_paths)).rank_dir(0), BLOCKS)
    try:
        with open(p) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    out = {}
    for h, v in (data.get("blocks") or {}).items():
        try:
            parent, depth, _, _ = v
            out[str(h)] = (parent if parent is None else str(parent), int(depth))
        except (TypeError, ValueError):
            continue
    return out


class Planner:
    """See the module docstring.

    Args:
        chunk_tokens: tokens per stored block ``T``; block_size: vLLM's block size ``N`` (divides ``T``);
        hash_block_size: tokens per entry of ``request.block_hashes`` (divides ``T``).
        index: ``{key: (parent, depth)}`` of the blocks stored at start.
    """

    def __init__(self, chunk_tokens: int, block_size: int, hash_block_size: int,
                 index: dict[str, tuple[str | None, int]]) -> None:
        if chunk_tokens % block_size or chunk_tokens % hash_block_size:
            raise ValueError(f"Planner: {chunk_tokens}-token blocks are not whole vLLM blocks of {block_size} "
                             f"(hashes per {hash_block_size})")
        self.T, self.N, self.hbs = int(chunk_tokens), int(block_size), int(hash_block_size)
        self.per_chunk = self.T // self.N
        self.index = dict(index)
        self.pending: set[str] = set()
        self.reqs: dict[str, _Req] = {}
        self._loads: list[tuple[str, list[LoadChunk]]] = []
        self.stats = {"lookups": 0, "hits": 0, "tokens_hit": 0, "blocks_planned": 0}

    # ------------------------------------------------------------------ keys
    def keys(self, request, n: int) -> list[str]:
        """Keys of stored blocks ``0 .. n-1`` of ``request`` (fewer when its hashes do not reach)."""
        hashes = request.block_hashes
        step = self.T // self.hbs
        out = []
        for i in range(n):
            j = (i + 1) * step - 1
            if j >= len(hashes):
                break
            h = hashes[j]
            out.append(h.hex() if isinstance(h, (bytes, bytearray)) else str(h))
        return out

    def _state(self, request) -> _Req:
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self.reqs[request.request_id] = _Req(request)
        st.request = request
        return st

    # ------------------------------------------------------------------ lookup and loads
    def add(self, request) -> None:
        self._state(request)

    def match(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """``(tokens to load past num_computed_tokens, whether asynchronously)``, as vLLM's
        ``get_num_new_matched_tokens`` returns it."""
        st = self._state(request)
        self.stats["lookups"] += 1
        usable = max(int(request.num_tokens) - 1, 0) // self.T
        hit, parent = 0, None
        for k in self.keys(request, usable):
            rec = self.index.get(k)
            if rec is None or rec[0] != parent:
                break
            hit += 1
            parent = k
        tokens = hit * self.T
        if tokens <= num_computed_tokens:
            return 0, False
        st.local_tokens = int(num_computed_tokens)
        return tokens - int(num_computed_tokens), True

    def after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """Plan the load of the ``num_external_tokens`` promised by :meth:`match` into ``block_ids``
        (the request's vLLM blocks, group 0)."""
        if num_external_tokens <= 0:
            return
        st = self._state(request)
        local, total = st.local_tokens, st.local_tokens + int(num_external_tokens)
        keys = self.keys(request, total // self.T)
        chunks: list[LoadChunk] = []
        for j in range(local // self.N, total // self.N):  # vLLM block j of the request
            c, off = divmod(j, self.per_chunk)
            if not chunks or chunks[-1].key != keys[c]:
                chunks.append(LoadChunk(keys[c], off, []))
            chunks[-1].block_ids.append(int(block_ids[j]))
        st.saved_upto = max(st.saved_upto, total // self.T)
        self._loads.append((request.request_id, chunks))
        self.stats["hits"] += 1
        self.stats["tokens_hit"] += int(num_external_tokens)

    # ------------------------------------------------------------------ saves
    def plan(self, scheduled: list[tuple[str, list[int] | None, bool]], num_scheduled_tokens: dict[str, int],
             finished: set[str]) -> Plan:
        """The step's :class:`Plan`.

        Args:
            scheduled: ``(request id, new vLLM block ids of group 0 or None, whether they replace the
                old ones)`` per scheduled request (new requests and resumed ones replace).
            num_scheduled_tokens: tokens each request computes in this step.
            finished: requests that finished since the last step (forgotten after this plan).
        """
        for req_id, new_ids, replace in scheduled:
            st = self.reqs.get(req_id)
            if st is None or new_ids is None:
                continue
            st.block_ids = list(new_ids) if replace else st.block_ids + list(new_ids)
        plan = Plan(loads=self._loads)
        self._loads = []
        for req_id, n in num_scheduled_tokens.items():
            st = self.reqs.get(req_id)
            if st is None:
                continue
            r = st.request
            valid = min(int(r.num_computed_tokens) + int(n), int(r.num_tokens))
            keys = self.keys(r, valid // self.T)
            chunks: list[SaveChunk] = []
            c = st.saved_upto
            while c < len(keys):
                key, parent = keys[c], keys[c - 1] if c else None
                ids = st.block_ids[c * self.per_chunk:(c + 1) * self.per_chunk]
                if len(ids) < self.per_chunk:
                    break  # not allocated yet (should not happen for computed tokens)
                if key in self.index or key in self.pending:
                    c += 1
                    continue
                if parent is not None and parent not in self.index and parent not in self.pending:
                    c = len(keys)  # its parent is gone: unreachable, give up on the rest of this request
                    break
                chunks.append(SaveChunk(key, parent, c, [int(b) for b in ids]))
                self.pending.add(key)
                c += 1
            st.saved_upto = c
            if chunks:
                plan.saves.append(chunks)
                self.stats["blocks_planned"] += len(chunks)
        for req_id in finished:
            self.reqs.pop(req_id, None)
        return plan

    def finished(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)

    # ------------------------------------------------------------------ worker events
    def on_events(self, stored, removed, skipped, snapshot: dict | None = None) -> None:
        """Apply the worker's events: the whole index (``snapshot``, first), blocks committed
        (``(key, parent, depth)``), removed, skipped."""
        if snapshot is not None:
            self.index = {k: (v[0], int(v[1])) for k, v in snapshot.items()}
        for key, parent, depth in stored:
            self.index[key] = (parent, int(depth))
            self.pending.discard(key)
        for key in skipped:
            self.pending.discard(key)
        for key in removed:
            self.index.pop(key, None)
