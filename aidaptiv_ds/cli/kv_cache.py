"""``aidaptiv-ds kv-cache --cache DIR [--clear] [--json]``: list, size or clear the prefix KV caches in a directory.

Lists every prefix KV cache (:mod:`aidaptiv_ds.inference.block_store`) under ``DIR`` (one per host
name): what it was written for (model, dtype, tokenizer), its block layout, blocks and tokens held,
bytes of blocks and bytes on the drive, whether a process has it open, and the bytes the node's
ledger booked for the KV cache on that drive. ``--clear`` deletes this host's cache (``--all-hosts``: every host's),
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
        out.append({"host": ns["host"], "dir": ns["dir"], "live": ns["live"], "bytes_on_disk": ns["bytes_on_disk"],
                    "blocks": len(blocks), "tokens": len(blocks) * (lay.block_tokens if lay else 0),
                    "block_bytes": len(blocks) * extent, "model": fp.get("model_name", ""),
                    "model_digest": fp.get("model", ""), "dtype": fp.get("dtype", ""),
                    "tokenizer": fp.get("tokenizer_class", ""), "layout": layout,
                    "ledger_bytes_written": ((ledger.get("runs") or {}).get(RUN_NAME) or {}).get("bytes_written", 0)})
    return out


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
        return 0
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
    return 0
