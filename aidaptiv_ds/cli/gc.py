"""``aidaptiv-ds gc --cache PATH [--delete]``: list the stores under cache paths and remove dead ones;
``aidaptiv-ds gc --checkpoint DIR [--delete]``: what interrupted checkpoint saves left.

A store (one rank of one run on one node) is *live* while its owner process holds the lock on
``owner.lock`` (:mod:`aidaptiv_ds.store.layout`). A run killed with ``kill -9``, or kept with
``keep_files``, leaves a dead store behind; ``--delete`` removes dead ones (``--run NAME`` limits
it to one run) and never touches a live store, a store of another host unless ``--all-hosts``, or
anything outside ``<cache_path>/aidaptiv_ds``. The endurance ledgers stay, and so do prefix KV caches
(kept on purpose; ``aidaptiv-ds kv-cache --cache DIR --clear`` removes one).

``--checkpoint DIR`` (repeatable: a save_dir, e.g. each node's directory of a checkpoint saved in
node-local parts) lists the tags in it -- complete, incomplete, or part i of n with its save and
whether its commit record is there -- and the staged and set-aside copies that interrupted saves
left, with what becomes of each (:func:`aidaptiv_ds.checkpoint.parts.gc_checkpoints`): restored into
place, removed, or kept because only the other nodes' directories tell whether a committed save
needs it. ``--delete`` does it. Tags in place are never touched. Not while a job saves there.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

from ..checkpoint.parts import gc_checkpoints
from ..inference.block_store import HEADER as KV_HEADER
from ..inference.block_store import RUN_NAME as KV_RUN
from ..store.layout import ROOT_NAME, hostname, list_namespaces
from ..units import format_bytes


def register(sub) -> None:
    p = sub.add_parser("gc", help="list stores on cache paths; delete dead ones", description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", action="append", default=[], metavar="PATH", help="cache path (repeatable)")
    p.add_argument("--checkpoint", action="append", default=[], metavar="DIR",
                   help="checkpoint save_dir (repeatable: give every node's directory of a node-local checkpoint)")
    p.add_argument("--delete", action="store_true", help="delete dead stores")
    p.add_argument("--run", help="only this run name")
    p.add_argument("--all-hosts", action="store_true", help="also stores of other hosts (shared network paths)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    """List (and with ``--delete`` remove dead) stores; says so when a path has none.

    Raises:
        ValueError: a ``--cache`` path does not exist or is not a directory (nothing is deleted then).
    """
    if not args.cache and not args.checkpoint:
        raise ValueError("give --cache PATH (stores on a cache path) or --checkpoint DIR (a checkpoint directory)")
    for path in args.checkpoint:
        if not os.path.isdir(path):
            raise ValueError(f"--checkpoint {path!r} is not a directory; give the save_dir of the checkpoints")
    for path in args.cache:
        if not os.path.isdir(path):
            what = "does not exist" if not os.path.exists(path) else "is not a directory"
            raise ValueError(f"--cache {path!r} {what}; give the cache path the runs used (the directory that "
                             f"holds {ROOT_NAME}/)")
    if args.checkpoint:
        _checkpoints(args)
        if not args.cache:
            return 0
    me = hostname()
    rows = []
    empty = []
    for path in args.cache:
        before = len(rows)
        for ns in list_namespaces(path):
            if args.run and ns["run"] != args.run:
                continue
            mine = ns["host"] == me or args.all_hosts
            kv = ns["run"] == KV_RUN and os.path.exists(os.path.join(ns["dir"], KV_HEADER))
            ns = dict(ns, cache_path=path, deleted=False, kv_cache=kv)
            if args.delete and not ns["live"] and mine and not kv:  # a KV cache is kept on purpose
                shutil.rmtree(ns["dir"])
                ns["deleted"] = True
                try:  # the run's directory once its last rank's store is gone (as a clean shutdown leaves it)
                    os.rmdir(os.path.dirname(ns["dir"]))
                except OSError:
                    pass  # another rank's store, live or kept, is still there
            rows.append(ns)
        if len(rows) == before:
            empty.append(path)
    if args.json:
        print(json.dumps(rows))
        return 0
    for path in empty:
        where = os.path.join(path, ROOT_NAME)
        why = f"{where} does not exist" if not os.path.isdir(where) else f"no store directories under {where}"
        print(f"no aidaptiv_ds store{' of run ' + args.run if args.run else ''} on {path} ({why})",
              file=sys.stdout)
    for r in rows:
        state = "live" if r["live"] else ("deleted" if r["deleted"] else "kv-cache" if r["kv_cache"] else "dead")
        print(f"{state:8s} {format_bytes(r['bytes_on_disk']):>12s}  {r['dir']}")
    dead = sum(r["bytes_on_disk"] for r in rows if not r["live"] and not r["deleted"] and not r["kv_cache"])
    if dead and not args.delete:
        print(f"{format_bytes(dead)} in dead stores; `aidaptiv-ds gc --delete --cache ...` removes them")
    return 0


def _checkpoints(args) -> None:
    rows = gc_checkpoints(args.checkpoint, args.delete)
    if args.json:
        print(json.dumps(rows))
        return
    for r in rows:
        if r["kind"] == "tag":
            print(f"tag      {r['path']}: {r['state']}" + (f" ({r['why']})" if r["why"] else ""))
        else:
            print(f"{r['state']:8s} {r['path']}: {r['why']}")
    if not any(r["kind"] != "tag" for r in rows):
        print(f"nothing left by interrupted saves in {', '.join(args.checkpoint)}")
    elif not args.delete and any(r["state"] in ("remove", "restore") for r in rows):
        print("`aidaptiv-ds gc --delete --checkpoint ...` does the above (restore / remove)")
