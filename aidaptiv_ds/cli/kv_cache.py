"""``aidaptiv-ds kv-cache --cache DIR [--verify] [--clear] [--json]``: list, size, verify or clear the prefix KV caches in a directory.

Lists every prefix KV cache (:mod:`aidaptiv_ds.inference.block_store`) under ``DIR`` (one per host
name): what it was written for (model, dtype, tokenizer), its block layout, blocks and tokens held,
bytes of blocks and bytes on the drive, whether a process has it open, and the bytes the node's
ledger booked for the KV cache on that drive; for a cache of the vLLM connector
(:mod:`aidaptiv_ds.inference.vllm`) also its counters (blocks loaded and written, saves skipped).
``--verify`` reads every block of this host's caches and checks its CRC32 (refused while a process
has the cache open); it exits 1 when one fails. ``--clear`` deletes this host's cache (``--all-hosts``: every host's),
never one a live process has open; the endurance ledger stays.
"""
from __future__ import annotations

import json
import os

from ..inference.block_store import BLOCKS, HEADER, RUN_NAME
from ..store.layout import Namespace, StoreInUseError, hostname, list_namespaces
from ..units import format_bytes


def register(sub) -> None:
    p = sub.add_parser("kv-cache", help="list, size or clear the prefix KV caches in a directory",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", required=True, metavar="DIR", help="the --kv_cache_path of launch/generate.py")
    p.add_argument("--clear", action="store_true", help="delete the cache (refused while a process has it open)")
    p.add_argument("--verify", action="store_true", help="read every block and check its CRC32 (exit 1 if one fails)")
    p.add_argument("--all-hosts", action="store_true", help="with --clear: also caches of other host names")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def describe(cache_dir: str) -> list[dict]:
    """One record per KV cache under ``cache_dir`` (see the module docstring)."""
    out = []
    for ns in list_namespaces(cache_dir):
        if ns["run"] != RUN_NAME or ns["rank"] != "rank0":
            continue
        hdr = _read(os.path.join(ns["dir"], HEADER))
        blocks = _read(os.path.join(ns["dir"], BLOCKS)).get("blocks", {}) or {}
        layout = hdr.get("layout", {}) or {}
        fp = hdr.get("fingerprint", {}) or {}
        from ..inference.layout import KVLayout

        try:
            lay = KVLayout(**layout)
            extent = -(-lay.block_nbytes // 4096) * 4096
        except (TypeError, ValueError):
            lay, extent = None, 0
        ledger = _read(os.path.join(os.path.dirname(os.path.dirname(ns["dir"])), "ledger.json"))
        conn = _read(os.path.join(ns["dir"], "kv_connector_stats.json")).get("connector")
        out.append({"host": ns["host"], "dir": ns["dir"], "live": ns["live"], "bytes_on_disk": ns["bytes_on_disk"],
                    "blocks": len(blocks), "tokens": len(blocks) * (lay.block_tokens if lay else 0),
                    "block_bytes": len(blocks) * extent, "model": fp.get("model_name", ""),
                    "model_digest": fp.get("model", ""), "dtype": fp.get("dtype", ""),
                    "tokenizer": fp.get("tokenizer_class", ""), "layout": layout, "connector": conn,
                    "cache_paths": hdr.get("cache_paths") or [cache_dir], "cache_dir": cache_dir,
                    "ledger_bytes_written": ((ledger.get("runs") or {}).get(RUN_NAME) or {}).get("bytes_written", 0)})
    return out


def verify(row: dict) -> list[tuple[str, str]]:
    """Read every block of the cache ``row`` (from :func:`describe`) and check its CRC32; ``[(hash, why)]``
    of the blocks that fail.

    Raises:
        StoreInUseError: a live process has it open.
    """
    from ..inference.block_store import KVBlockStore, read_header
    from ..inference.fingerprint import Fingerprint
    from ..inference.layout import KVLayout

    hdr = read_header(Namespace([row["cache_dir"]], RUN_NAME, 0, host=row["host"]))
    if hdr is None:
        return []
    store = KVBlockStore(list(row["cache_paths"]), Fingerprint.from_dict(hdr["fingerprint"]), KVLayout(**hdr["layout"]),
                         capacity=1 << 62, dram_budget=0)
    try:
        return store.verify()
    finally:
        store.close()


def clear(cache_dir: str, host: str) -> None:
    """Delete ``host``'s KV cache under ``cache_dir``.

    Raises:
        StoreInUseError: a live process has it open (nothing is deleted).
    """
    ns = Namespace([cache_dir], RUN_NAME, 0, host=host)
    ns.acquire()
    ns.remove_files()


def run(args) -> int:
    if not os.path.isdir(args.cache):
        raise ValueError(f"--cache {args.cache!r}: no such directory")
    rows = describe(args.cache)
    me = hostname()
    failed = 0
    for r in rows:
        if args.verify and r["host"] == me and r["blocks"]:
            try:
                bad = verify(r)
            except StoreInUseError as e:
                raise ValueError(f"{e} (a process is serving with this KV cache; stop it first)") from None
            r["verify"] = {"blocks_checked": r["blocks"], "failed": [{"hash": h, "why": w} for h, w in bad]}
            failed += len(bad)
    for r in rows:
        r["cleared"] = False
        if args.clear and (r["host"] == me or args.all_hosts):
            try:
                clear(args.cache, r["host"])
                r["cleared"] = True
            except StoreInUseError as e:
                raise ValueError(f"{e} (a process is generating with this KV cache; stop it first)") from None
    if args.json:
        print(json.dumps(rows))
        return 1 if failed else 0
    if not rows:
        print(f"no KV cache under {os.path.abspath(args.cache)}")
    for r in rows:
        state = "cleared" if r["cleared"] else ("live" if r["live"] else "idle")
        lay = r["layout"]
        print(f"{state:8s} {r['blocks']} blocks, {r['tokens']} tokens, {format_bytes(r['block_bytes'])} of blocks, "
              f"{format_bytes(r['bytes_on_disk'])} on disk, {format_bytes(r['ledger_bytes_written'])} written (ledger)  "
              f"{r['dir']}")
        print(f"         written for {r['model'] or '?'} ({r['dtype']}, tokenizer {r['tokenizer'] or '?'}), "
              f"{lay.get('block_tokens', '?')} tokens per block, {lay.get('layers', '?')} layers x "
              f"{lay.get('kv_heads', '?')} KV heads x {lay.get('head_dim', '?')}")
        c = r.get("connector")
        if c:
            print(f"         vLLM connector: {c.get('blocks_loaded', 0)} blocks loaded ({c.get('tokens_loaded', 0)} "
                  f"tokens), {c.get('blocks_load_failed', 0)} failed, {c.get('blocks_written', 0)} written, "
                  f"{c.get('saves_skipped', 0)} saves skipped (last run)")
        v = r.get("verify")
        if v:
            print(f"         verify: {v['blocks_checked']} blocks read, {len(v['failed'])} failed their CRC32"
                  + "".join(f"\n           {f['hash'][:16]}: {f['why']}" for f in v["failed"]))
    return 1 if failed else 0
