"""Checkpoints in node-local parts: which ranks share a directory, the commit across nodes, and what a
load, ``export`` and ``gc`` accept.

**Who shares a directory.** DeepSpeed's ``checkpoint.use_node_local_storage`` means every node saves
to its own disk under the same ``save_dir``; users also give each node its own path. Neither the
flag nor the path strings say which ranks really see one directory (a path may be a network mount,
two strings one directory), so a save asks the directories: every rank creates ``save_dir`` (each
node its own), then tries to create ``<save_dir>/.aidaptiv-save.<token>`` with ``link(2)`` from a
file of its own holding its rank (:func:`claim`; ``token`` is new for every save and sent by rank
0). ``link`` is atomic on local and network filesystems alike, so in each directory exactly one rank
wins and every rank reads the winner's rank: ranks that read the same winner share the directory
(:func:`group_parts`). One group: the layout of :mod:`aidaptiv_ds.checkpoint.format`, unchanged.
Several groups: each writes a *part*.

**The commit across nodes** (each step on every part's leader, the lowest rank of its group; the
ranks agree between the steps, so no part moves on before every part finished the step before):

1. every rank writes its files into ``<save_dir>/.aidaptiv-staging/<tag>`` (DeepSpeed's and ours);
2. each leader writes its part's manifest (its ranks' files with their CRC32, ``save_id``, the part's
   index, ranks and host, and the list of every part) -- the part is *prepared*;
3. each leader switches its staged part into ``<save_dir>/<tag>``, setting an existing part of that
   tag aside (``.aidaptiv-retired/<tag>``) rather than deleting it;
4. rank 0 writes the commit record ``<tag>/aidaptiv/COMMIT.json`` into its part: the tag, the
   ``save_id``, and every part's ranks, host, directory and manifest CRC32. **This file is the
   commit**: before it exists the save did not happen;
5. the other leaders write the same record into their parts (a copy: any one of them serves a load),
   delete the part they set aside and write ``latest``.

**What a load accepts** (:func:`decide`): every rank lists what it sees of the tag -- the part in
place, a staged one, one set aside (:func:`inspect_tag`) -- and the ranks exchange the lists. A
save is loadable when a commit record exists on some node and every rank finds, in its own
directory, a complete part of that ``save_id`` holding its rank whose manifest has the CRC32 the
record names. The newest such save is loaded (a save set aside when its successor never committed:
an interrupted re-save of a tag loads the old one). Otherwise the load refuses on every rank, naming
each node whose part is missing, incomplete, from another save, or holds other ranks, with its
path. ``latest`` is written per node after the commit; when the nodes' ``latest`` differ (a crash
between them), the newest tag that is loadable everywhere is taken.

**Crash safety.** A ``kill -9`` of any node at any moment leaves the previous checkpoint loadable
on all: before step 4 no commit record of the new save exists (its parts are ignored, and a part of
the same tag set aside in step 3 is still there), after it the new save is complete on every node.
The next save finishes or removes the leftovers (:func:`cleanup_plan`, run on every part), as does
``aidaptiv-ds gc --checkpoint``.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import time

from ..io.atomic import ChecksumMismatch, atomic_write, fsync_dir, read_json_checked, write_json
from ..io.errors import FileWriteError
from .format import COMMIT, DIRNAME, MANIFEST, RETIRED, STAGING, IncompleteCheckpointError, adopt_root_files, \
    crc32_file, manifest_ranks, publish, read_manifest, retired_dir, staging_dir, tag_dir

CLAIM = ".aidaptiv-save."  # <save_dir>/.aidaptiv-save.<token>: the rank that reached this directory first
#: where a candidate part of a tag lies in one directory, in the order a load prefers them
WHERE = {"in place": tag_dir, "staged": staging_dir, "set aside": retired_dir}


# ---------------------------------------------------------------------------------------------- who shares a directory
def claim(save_dir: str, token: str, rank: int) -> int:
    """Claim ``save_dir`` for this save (``token``): the rank of whoever claimed it first, maybe ``rank``.

    Writes ``<save_dir>/.aidaptiv-save.<token>.<rank>`` holding ``rank``, fsyncs it, and ``link``s it
    to ``<save_dir>/.aidaptiv-save.<token>``; ``EEXIST`` means another rank sharing the directory was
    first, whose rank the file then holds (written whole before its link, so never seen half-written).

    Raises:
        FileWriteError: the directory cannot be written, naming it (before any checkpoint byte is written).
    """
    final = os.path.join(save_dir, CLAIM + token)
    mine = f"{final}.{rank}"
    try:
        fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, str(rank).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(mine, final)
        except FileExistsError:
            pass
        with open(final) as f:
            return int(f.read().strip())
    except OSError as e:
        raise FileWriteError(save_dir, 0, None, e.errno, step="claiming the checkpoint directory") from e
    finally:
        try:
            os.unlink(mine)
        except OSError:
            pass


def release_claim(save_dir: str, token: str) -> None:
    """Remove this save's claim file (by the part's leader, once every rank has read it)."""
    try:
        os.unlink(os.path.join(save_dir, CLAIM + token))
    except FileNotFoundError:
        pass


def stale_claims(save_dir: str, token: str | None = None) -> list[str]:
    """Claim files of earlier saves (left by a crash between the claim and its release): all but those
    of the save ``token`` (None: all)."""
    if not os.path.isdir(save_dir):
        return []
    return [os.path.join(save_dir, n) for n in sorted(os.listdir(save_dir))
            if n.startswith(CLAIM) and not (token and n.startswith(CLAIM + token))]


@dataclasses.dataclass(frozen=True)
class Part:
    """The ranks that see one save directory: ``index`` (parts ordered by their lowest rank),
    ``ranks`` (ascending; the first is the part's leader), the ``host`` of the leader and the
    ``save_dir`` as the leader named it."""
    index: int
    ranks: tuple[int, ...]
    host: str
    save_dir: str

    @property
    def leader(self) -> int:
        return self.ranks[0]

    def as_dict(self) -> dict:
        return {"index": self.index, "ranks": list(self.ranks), "host": self.host, "save_dir": self.save_dir}


def group_parts(claims: list[tuple[int, str, str]]) -> list[Part]:
    """The parts of a save from every rank's ``(claimed rank, host, save_dir)`` (index = rank).

    Ranks whose directory was claimed by the same rank share it. Raises ValueError when the claims
    contradict each other (a rank in one group reading another group's claimant), which a filesystem
    that loses a ``link`` would cause.
    """
    groups: dict[int, list[int]] = {}
    for r, (owner, _, _) in enumerate(claims):
        groups.setdefault(int(owner), []).append(r)
    for owner, ranks in groups.items():
        if owner not in ranks:
            raise ValueError(f"aidaptiv_ds: ranks {ranks} read rank {owner}'s claim of their checkpoint directory "
                             f"{claims[ranks[0]][2]!r}, but rank {owner} claimed another directory: the filesystem "
                             f"did not keep one claim per directory")
    parts = []
    for i, ranks in enumerate(sorted(groups.values(), key=min)):
        lead = min(ranks)
        parts.append(Part(i, tuple(sorted(ranks)), claims[lead][1], claims[lead][2]))
    return parts


# ---------------------------------------------------------------------------------------------- what one rank sees
def _candidate(path: str, where: str) -> dict:
    """One directory that may hold (a part of) a tag: its manifest's facts, its commit record, or
    why it cannot be loaded (``problem``)."""
    c = {"where": where, "path": path, "problem": None, "save_id": None, "ranks": [], "world_size": None,
         "part": None, "parts": None, "manifest_crc32": None, "created": None, "global_steps": None, "commit": None,
         "version": None}
    try:
        man = read_manifest(path)
    except (IncompleteCheckpointError, OSError, ValueError, KeyError) as e:
        c["problem"] = str(e)
        return c
    part = man.get("part")
    c.update(save_id=man.get("save_id"), ranks=manifest_ranks(man), world_size=int(man["world_size"]),
             part=None if part is None else {"index": int(part["index"]), "count": int(part["count"]),
                                             "host": part.get("host")},
             parts=man.get("parts"), manifest_crc32=crc32_file(os.path.join(path, DIRNAME, MANIFEST)),
             created=man.get("created"), global_steps=man.get("global_steps"), version=int(man.get("version", 1)))
    commit = os.path.join(path, DIRNAME, COMMIT)
    if os.path.isfile(commit):
        try:
            c["commit"] = read_json_checked(commit)
        except (ChecksumMismatch, OSError) as e:
            c["problem"] = f"its commit record is damaged: {e}"
    return c


def inspect_tag(save_dir: str, tag: str) -> list[dict]:
    """Every directory of ``save_dir`` that may hold ``tag``: in place, staged, set aside (those that exist)."""
    return [_candidate(fn(save_dir, tag), where) for where, fn in WHERE.items() if os.path.isdir(fn(save_dir, tag))]


def rank_view(save_dir: str, tags, rank: int, host: str) -> dict:
    """What rank ``rank`` on ``host`` sees in its ``save_dir``: ``latest`` and each of ``tags``
    (:func:`inspect_tag`). Plain data, exchanged between the ranks (``all_gather_object``)."""
    save_dir = os.path.abspath(save_dir)
    latest = None
    lp = os.path.join(save_dir, "latest")
    if os.path.isfile(lp):
        with open(lp) as f:
            latest = f.read().strip() or None
    return {"rank": rank, "host": host, "save_dir": save_dir, "latest": latest,
            "tags": {str(t): inspect_tag(save_dir, str(t)) for t in tags if t is not None}}


def leftover_tags(save_dir: str) -> list[str]:
    """Tags with a staged or set-aside directory in ``save_dir`` (an interrupted save's leftovers)."""
    out = set()
    for root in (STAGING, RETIRED):
        base = os.path.join(save_dir, root)
        if os.path.isdir(base):
            out.update(n for n in os.listdir(base) if os.path.isdir(os.path.join(base, n)) and not n.startswith("."))
    return sorted(out)


# ---------------------------------------------------------------------------------------------- what a load accepts
@dataclasses.dataclass
class Decision:
    """The save of ``tag`` a load takes: per rank the directory to read (``paths[rank]``), whether it
    is in node-local parts, its ``save_id``, world size, step and commit time. ``loadable`` False: in
    the one-directory layout no rank finds the tag complete (the load then names it as such, with
    the complete tags it can offer)."""
    tag: str
    paths: list[str]
    parts: bool
    save_id: str | None
    world_size: int
    global_steps: int | None
    created: float | None
    loadable: bool = True


def _when(ts) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "at an unknown time"


def _node(view: dict) -> str:
    return f"node {view['host']} (rank {view['rank']})"


def _state(c: dict | None, view: dict, tag: str, save_id: str | None, rank: int) -> str:
    """Why a rank's directory does not serve ``save_id`` of ``tag``, for an error message."""
    where = tag_dir(view["save_dir"], tag)
    if c is None:
        return f"{_node(view)}: {where} is missing"
    if c["problem"]:
        return f"{_node(view)}: {c['path']} is incomplete or damaged: {c['problem']}"
    if save_id is not None and c["save_id"] != save_id:
        steps = f"step {c['global_steps']}, " if c["global_steps"] is not None else ""
        return (f"{_node(view)}: {c['path']} holds another save of {tag!r} ({steps}written {_when(c['created'])}, "
                f"save id {c['save_id']}), not save {save_id}")
    if rank not in c["ranks"]:
        return (f"{_node(view)}: {c['path']} holds the part of ranks {c['ranks']}, not rank {rank} (the ranks "
                f"moved between nodes: start each node with the node rank it had when it saved)")
    return f"{_node(view)}: {c['path']} does not match the commit record"


def _committed(views: list[dict], tag: str) -> tuple[list[dict], list[str]]:
    """The commit records of ``tag`` found on any rank (newest first), and their problems."""
    recs: dict[str, dict] = {}
    problems = []
    for v in views:
        for c in v["tags"].get(tag, []):
            rec = c.get("commit")
            if rec is None:
                continue
            if rec.get("tag") != tag:
                problems.append(f"{_node(v)}: {c['path']}/{DIRNAME}/{COMMIT} is the record of tag {rec.get('tag')!r}")
                continue
            other = recs.get(rec["save_id"])
            if other is not None and other != rec:
                problems.append(f"{_node(v)}: {c['path']}/{DIRNAME}/{COMMIT} differs from another copy of the record "
                                f"of save {rec['save_id']}")
                continue
            recs[rec["save_id"]] = rec
    return sorted(recs.values(), key=lambda r: r.get("created", 0), reverse=True), problems


def _serves(c: dict, rec: dict, rank: int) -> bool:
    if c["problem"] or c["save_id"] != rec["save_id"] or c["part"] is None or rank not in c["ranks"]:
        return False
    want = rec["parts"][c["part"]["index"]]
    return want["manifest_crc32"] == c["manifest_crc32"] and sorted(want["ranks"]) == sorted(c["ranks"])


def decide(views: list[dict], tag: str, world: int | None = None) -> Decision:
    """The save of ``tag`` to load, from the :func:`rank_view` of every rank of a job (``world``: its
    size; ``views[r]`` is rank r's) -- the same answer on every rank, which all hold the same list --
    or, with ``world`` None, from the views of whatever directories were given (:func:`dir_views`:
    ``export``, ``gc``), where a save in parts is taken only when every rank it names is among them.

    Raises:
        IncompleteCheckpointError: no save of ``tag`` is complete and committed on every node: names
            each node whose part is missing, incomplete, from another save or of other ranks, with
            its path (for the one-directory layout, each rank that does not find the tag); a save in
            parts by another number of ranks than the job's; parts of another save not given.
    """
    tag = str(tag)
    cands = [v["tags"].get(tag, []) for v in views]
    kinds = {c["part"] is not None for cs in cands for c in cs if not c["problem"]}
    if kinds == {True}:
        return _decide_parts(views, tag, world)
    if kinds == {True, False}:
        raise IncompleteCheckpointError(
            f"aidaptiv_ds: checkpoint {tag!r} is a node-local part on some nodes and a whole checkpoint on others ("
            + "; ".join(f"{_node(v)}: " + ", ".join(f"{c['path']} ({'part' if c['part'] else 'whole'})" for c in cs)
                        for v, cs in zip(views, cands) if cs) + "). It will not be loaded. Fix: load each "
            "layout from directories that hold only it.")
    return _decide_whole(views, tag, cands)


def _decide_whole(views: list[dict], tag: str, cands: list[list[dict]]) -> Decision:
    """The one-directory layout: each rank's directory (shared, or a whole copy per node) must hold the
    tag complete -- in place, or, after a switch cut between its renames, staged or set aside -- and
    all of them the same save."""
    chosen, bad = [], []
    for v, cs in zip(views, cands):
        inplace = [c for c in cs if c["where"] == "in place"]
        pick = inplace[0] if inplace else next((c for c in cs if not c["problem"]), None)
        if pick is None or pick["problem"]:
            bad.append((v, pick))
        chosen.append(pick)
    if bad and len(bad) < len(views):
        raise IncompleteCheckpointError(
            f"aidaptiv_ds: checkpoint {tag!r} cannot be loaded on every rank: "
            + "; ".join(_state(c, v, tag, None, v["rank"]) for v, c in bad)
            + ". The other ranks found it complete; every rank must load the same checkpoint. Fix: give each "
              "node a copy of the same save, or load another tag every node holds.")
    if bad:  # no rank can load it: the caller names it as today (with the complete tags it offers)
        return Decision(tag, [c["path"] if c else tag_dir(v["save_dir"], tag) for v, c in zip(views, chosen)],
                        False, None, 0, None, None, loadable=False)
    ids = {c["save_id"] for c in chosen}
    sizes = {c["world_size"] for c in chosen}
    if len(ids) > 1 or len(sizes) > 1:
        raise IncompleteCheckpointError(
            f"aidaptiv_ds: the ranks see different saves of checkpoint {tag!r}: "
            + "; ".join(f"{_node(v)}: {c['path']} (save id {c['save_id']}, {c['world_size']} ranks, written "
                        f"{_when(c['created'])})" for v, c in zip(views, chosen))
            + ". It will not be loaded. Fix: give every node the same save.")
    c0 = chosen[0]
    return Decision(tag, [c["path"] for c in chosen], False, c0["save_id"], c0["world_size"], c0["global_steps"],
                    c0["created"])


def _decide_parts(views: list[dict], tag: str, world: int | None) -> Decision:
    recs, problems = _committed(views, tag)
    notes = []
    for rec in recs:
        if world is not None and int(rec["world_size"]) != world:
            notes.append(f"save {rec['save_id']} was written by {rec['world_size']} ranks and this job has {world}: "
                         f"each rank resumes from its own node's part, so the world size and the node of every rank "
                         f"must be those of the save. Fix: resume with {rec['world_size']} ranks on the same nodes, "
                         f"or gather the parts and export them (aidaptiv-ds export DIR_NODE0 DIR_NODE1 ...)")
            continue
        paths: dict[int, str] = {}
        for r in range(int(rec["world_size"])):
            path = next((c["path"] for v in views if v["rank"] == r for c in v["tags"].get(tag, [])
                         if _serves(c, rec, r)), None)
            if path is None:
                break
            paths[r] = path
        else:
            return Decision(tag, [paths[r] for r in range(int(rec["world_size"]))], True, rec["save_id"],
                            int(rec["world_size"]), rec.get("global_steps"), rec.get("created"))
    lines = list(problems)
    held = {c["save_id"] for v in views for c in v["tags"].get(tag, []) if c["where"] == "in place" and c["commit"]}
    if len(held) > 1:
        head = f"aidaptiv_ds: the nodes hold parts of different saves of checkpoint {tag!r}"
        for v in views:
            for c in v["tags"].get(tag, []):
                if c["where"] == "in place":
                    rec = c["commit"] or {}
                    lines.append(f"{_node(v)}: {c['path']} holds save {c['save_id']} (step {c['global_steps']}, "
                                 + (f"committed {_when(rec.get('created'))}" if rec else "not committed") + ")")
        lines.append("each node must hold its part of one save (a part copied from another job or another save, "
                     "or a node that saved elsewhere)")
    elif recs:
        rec = recs[0]
        head = (f"aidaptiv_ds: checkpoint {tag!r} (node-local parts of save {rec['save_id']}, step "
                f"{rec.get('global_steps')}, committed {_when(rec.get('created'))} by "
                + ", ".join(f"node {p['host']} ranks {p['ranks']} in {p['save_dir']}" for p in rec["parts"])
                + ") is not complete " + ("on every node" if world is not None else "in the directories given"))
        lines += notes[:1]
        for p in rec["parts"]:
            mine = [v for v in views if v["rank"] in p["ranks"]]
            if not mine:
                lines.append(f"the part of node {p['host']} (ranks {p['ranks']}), which it saved to {p['save_dir']} "
                             f"on that node, is not among the directories given")
                continue
            for v in mine:
                cs = v["tags"].get(tag, [])
                if any(_serves(c, rec, v["rank"]) for c in cs):
                    continue
                same = [c for c in cs if c["save_id"] == rec["save_id"]]
                c = (same or [c for c in cs if c["where"] == "in place"] or cs or [None])[0]
                lines.append(_state(c, v, tag, rec["save_id"], v["rank"]))
    else:
        head = (f"aidaptiv_ds: checkpoint {tag!r} has no commit record on any node: its save did not finish on "
                f"every node (rank 0 writes {DIRNAME}/{COMMIT} once every node's part is in place)")
        for v in views:
            cs = v["tags"].get(tag, [])
            c = (cs or [None])[0]
            if c is None or c["problem"]:
                lines.append(_state(c, v, tag, None, v["rank"]))
            else:
                lines.append(f"{_node(v)}: {c['path']} holds an uncommitted part (save id {c['save_id']})")
    raise IncompleteCheckpointError(f"{head}: " + "; ".join(dict.fromkeys(lines)) + ". It will not be loaded.")


def choose_tag(views: list[dict], tag: str | None) -> str | None:
    """The tag a load takes: ``tag`` when given; else the one every rank's ``latest`` names; else
    (the nodes' ``latest`` differ: a save was cut between writing them) the newest of the named tags
    that :func:`decide` accepts. None when no rank has ``latest``.

    ``views`` must hold every tag named by any rank's ``latest`` (:func:`rank_view`).

    Raises:
        IncompleteCheckpointError: some ranks have ``latest`` and others not, or none of the named tags
            is loadable everywhere (naming the nodes and their ``latest``).
    """
    if tag is not None:
        return str(tag)
    named = [v["latest"] for v in views]
    if all(t is None for t in named):
        return None
    if all(t == named[0] for t in named):
        return named[0]
    ok, errors = [], []
    for t in sorted({t for t in named if t is not None}):
        try:
            d = decide(views, t, len(views))
        except IncompleteCheckpointError as e:
            errors.append(e)
            continue
        if d.loadable:
            ok.append((d.created or 0, t))
    if not ok and len(errors) == 1:  # one tag named, by some nodes only: why it is not everywhere
        raise errors[0]
    detail = "; ".join(f"{_node(v)}: {os.path.join(v['save_dir'], 'latest')} "
                       + (f"names {v['latest']!r}" if v["latest"] else "is missing") for v in views)
    if not ok:
        raise IncompleteCheckpointError(f"aidaptiv_ds: the nodes' 'latest' files name different checkpoints and none "
                                        f"of them is complete on every node: {detail}. Fix: pass the tag to load "
                                        f"explicitly, or start without loading.")
    return max(ok)[1]


# ---------------------------------------------------------------------------------------------- the commit, per part
def prepare_part(staged: str, world_size: int, extra: dict, part: Part, parts: list[Part]) -> int:
    """Step 2, on a part's leader once its ranks' files are staged at ``staged``: the part's manifest
    (:func:`~aidaptiv_ds.checkpoint.writer.write_manifest` for its ranks, with its place among
    ``parts``). Returns the manifest's CRC32 (what the commit record names).

    Raises:
        IncompleteCheckpointError: a rank of the part did not finish its files.
    """
    from .writer import write_manifest
    write_manifest(staged, world_size, dict(extra, part=dict(part.as_dict(), count=len(parts)),
                                            parts=[p.as_dict() for p in parts]), list(part.ranks))
    return manifest_crc(staged)


def switch_part(save_dir: str, tag: str, kill_point=lambda name: None) -> str:
    """Step 3: the staged part into ``<save_dir>/<tag>``, an existing part of the tag set aside."""
    return publish(save_dir, tag, kill_point, keep_old=True)


def commit_record(tag: str, save_id: str, world_size: int, global_steps, parts: list[Part],
                  manifest_crcs: list[int], created: float | None = None) -> dict:
    """The commit record of a save in parts (see module docstring, step 4); ``created``: rank 0's
    clock, so that every copy of the record is the same."""
    return {"tag": str(tag), "save_id": save_id, "world_size": int(world_size), "global_steps": global_steps,
            "created": time.time() if created is None else float(created),
            "parts": [dict(p.as_dict(), manifest_crc32=int(c)) for p, c in zip(parts, manifest_crcs)]}


def write_commit(tag_path: str, record: dict) -> None:
    """Write ``<tag_path>/aidaptiv/COMMIT.json`` (self-CRC, fsynced, renamed into place): step 4 on
    rank 0 (the commit), a copy in step 5 on the other parts."""
    write_json(os.path.join(tag_path, DIRNAME, COMMIT), record, checked=True)
    fsync_dir(os.path.join(tag_path, DIRNAME))


def finish_part(save_dir: str, tag: str, record: dict | None, save_latest: bool,
                kill_point=lambda name: None) -> None:
    """Step 5 on a part's leader after the commit: the copy of the record (``record``; None on rank
    0's part, which holds the original), the old part deleted, DeepSpeed's recovery scripts beside
    the tags, the empty staging directory gone, then ``latest``."""
    import shutil

    if record is not None:
        write_commit(tag_dir(save_dir, tag), record)
    shutil.rmtree(retired_dir(save_dir, tag), ignore_errors=True)
    adopt_root_files(save_dir)
    for root in (RETIRED, STAGING):  # empty unless other tags have leftovers there
        try:
            os.rmdir(os.path.join(save_dir, root))
        except OSError:
            pass
    kill_point("before_latest")
    if save_latest:
        write_latest(save_dir, tag)
    kill_point("after_latest")


def write_latest(save_dir: str, tag: str) -> None:
    """Point ``<save_dir>/latest`` at ``tag`` atomically (DeepSpeed's format: the tag as text)."""
    atomic_write(os.path.join(save_dir, "latest"), str(tag).encode())


def manifest_crc(tag_path: str) -> int:
    """CRC32 of a part's manifest file (what the commit record names)."""
    return crc32_file(os.path.join(tag_path, DIRNAME, MANIFEST))


# ---------------------------------------------------------------------------------------------- leftovers
def dir_views(dirs: list[str], tags) -> list[dict]:
    """Views (:func:`rank_view`) of directories given by hand (``export``, ``gc``): one per rank whose
    part a directory holds of any of ``tags`` (its node's host from the part's manifest), or one
    (rank None) for a directory with no part."""
    out = []
    for d in dirs:
        base = rank_view(d, tags, -1, "?")
        by_rank: dict[int, str] = {}
        for cs in base["tags"].values():
            for c in cs:
                if c["part"] is not None:
                    for r in c["ranks"]:
                        by_rank.setdefault(r, c["part"].get("host") or "?")
        if not by_rank:
            out.append(dict(base, rank=None, host=os.path.basename(os.path.abspath(d))))
        out += [dict(base, rank=r, host=h) for r, h in sorted(by_rank.items())]
    return out


def cleanup_plan(views: list[dict], tag: str, dirs: list[str], world: int | None = None
                 ) -> list[tuple[str, str, str]]:
    """What to do with the staged and set-aside copies of ``tag`` in ``dirs`` (each a directory some
    view of ``views`` sees), so that afterwards the save a load takes lies in place and nothing
    else is kept that no load could take.

    Returns ``[(action, path, why)]`` with action ``"restore"`` (into place, the part in place, if
    any, removed first), ``"remove"`` or ``"keep"``. The save :func:`decide` takes (``world``: the
    views are those of a whole job) is restored where it was set aside, and the other copies go.
    When it takes none -- or cannot tell, the views lacking a node's part -- only what no committed
    save can need goes: a staged part (a part is committed only after every part left the staging
    directory), and a set-aside part whose successor in place holds a commit record of its own. The
    one-directory layout is finished as :func:`~aidaptiv_ds.checkpoint.format.recover` does.
    """
    tag = str(tag)
    try:
        d: Decision | None = decide(views, tag, world)
    except IncompleteCheckpointError as e:
        d, why_not = None, str(e)
    else:
        why_not = ""
    if d is not None and not d.loadable:
        d, why_not = None, f"no copy of {tag!r} is complete"
    plan = []
    for save_dir in dirs:
        save_dir = os.path.abspath(save_dir)
        cs = next(v for v in views if v["save_dir"] == save_dir)["tags"].get(tag, [])
        inplace = next((c for c in cs if c["where"] == "in place"), None)
        keep = set(d.paths) if d is not None else set()
        for c in cs:
            if c["where"] == "in place":
                continue
            if d is not None:
                if c["path"] in keep:
                    plan.append(("restore", c["path"], f"the loadable save of {tag!r} was {c['where']}"))
                else:
                    plan.append(("remove", c["path"], f"not the loadable save of {tag!r}"))
            elif c["part"] is None:
                if inplace is None and not c["problem"] and not any(x[0] == "restore" for x in plan):
                    plan.append(("restore", c["path"], f"a complete copy of {tag!r}, nothing in place"))
                else:
                    plan.append(("remove", c["path"], "incomplete, or a copy of a tag in place"))
            elif c["where"] == "staged" or c["problem"]:
                plan.append(("remove", c["path"], "a part never committed (still staged) or incomplete"))
            elif inplace is not None and inplace["commit"] and inplace["commit"]["save_id"] == inplace["save_id"] \
                    and not inplace["problem"]:
                plan.append(("remove", c["path"], f"replaced by committed save {inplace['save_id']} in place"))
            else:
                plan.append(("keep", c["path"], f"may be the committed save of {tag!r} ({why_not}); the next save or "
                                                f"load of the job on all nodes, or gc given every node's directory, "
                                                f"decides"))
    return plan


def apply_plan(save_dir: str, tag: str, plan: list[tuple[str, str, str]]) -> list[str]:
    """Carry out :func:`cleanup_plan`'s actions that concern ``save_dir``; returns one line per action.

    A restore first deletes the part in place (if any: one no load takes), then renames the restored
    copy into place: a crash in between leaves the restored copy where :func:`inspect_tag` still
    finds it, and a half-deleted part in place is not the one :func:`decide` takes.
    """
    import shutil

    done = []
    root = os.path.abspath(save_dir)
    for action, path, why in plan:
        if not os.path.abspath(path).startswith(root + os.sep):
            continue
        if action == "remove":
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {path} ({why})")
        elif action == "restore":
            final = tag_dir(save_dir, tag)
            shutil.rmtree(final, ignore_errors=True)  # an uncommitted part (a load prefers the restored copy)
            try:
                os.rename(path, final)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
            fsync_dir(save_dir)
            done.append(f"restored {final} from {path} ({why})")
    for root_name in (STAGING, RETIRED):
        try:
            os.rmdir(os.path.join(save_dir, root_name))
        except OSError:
            pass
    return done


# ---------------------------------------------------------------------------------------------- export and gc
def resolve_dirs(dirs: list[str], tag: str | None) -> tuple[list[str], str]:
    """The save directories and the tag that ``export``/``gc`` were given: each of ``dirs`` is a
    ``save_dir`` or a tag directory in one (then its name is the tag); the tag is ``tag``, else the
    one the directories' ``latest`` files name.

    Raises:
        ValueError: no tag given and no ``latest`` anywhere, or the ``latest`` files name different tags.
    """
    save_dirs, named = [], {}
    for d in dirs:
        d = os.path.abspath(d)
        if os.path.isdir(os.path.join(d, DIRNAME)):
            save_dirs.append(os.path.dirname(d))
            named[d] = os.path.basename(d)
            continue
        save_dirs.append(d)
        lp = os.path.join(d, "latest")
        if os.path.isfile(lp):
            with open(lp) as f:
                named[d] = f.read().strip()
    if tag is not None:
        return save_dirs, str(tag)
    tags = set(named.values())
    if not tags:
        raise ValueError(f"{', '.join(dirs)}: no 'latest' file and no --tag given; pass --tag TAG")
    if len(tags) > 1:
        raise ValueError("the directories name different tags (" + ", ".join(f"{d}: {t}" for d, t in named.items())
                         + "); pass --tag TAG")
    return save_dirs, tags.pop()


def gather_parts(dirs: list[str], tag: str) -> list[str]:
    """The tag directories to read ``tag`` from, out of the save directories ``dirs`` (one per node,
    copied or mounted here): every part of its committed save, or its one directory.

    Raises:
        IncompleteCheckpointError: a part is not among ``dirs`` (naming the node, its ranks and the
            directory it saved to), incomplete or from another save; or the tag is incomplete.
    """
    d = decide(dir_views(dirs, [tag]), tag)
    if not d.loadable:
        return [d.paths[0]]
    return list(dict.fromkeys(d.paths))


def gc_checkpoints(dirs: list[str], delete: bool) -> list[dict]:
    """``aidaptiv-ds gc --checkpoint``: the tags of each directory and what interrupted saves left,
    with what :func:`cleanup_plan` does with it (over all ``dirs`` together: give every node's
    directory of a save in parts to decide what only all of them tell); with ``delete``, do it, and
    remove stale claim files. Never touches a tag in place.

    Returns rows ``{"dir", "kind": "tag"|"leftover"|"claim", "path", "state", "why"}``.
    """
    from .format import list_tags

    dirs = [os.path.abspath(d) for d in dirs]
    rows = []
    for d in dirs:
        for t in list_tags(d):
            for c in inspect_tag(d, t)[:1]:
                if c["problem"]:
                    state = "incomplete"
                elif c["part"] is None:
                    state = "complete"
                else:
                    state = (f"part {c['part']['index'] + 1} of {c['part']['count']} (ranks {c['ranks']}), save "
                             f"{c['save_id']}, " + ("committed" if c["commit"] and c["commit"]["save_id"] ==
                                                    c["save_id"] else "no commit record here"))
                rows.append({"dir": d, "kind": "tag", "path": c["path"], "state": state, "why": c["problem"] or ""})
    tags = sorted({t for d in dirs for t in leftover_tags(d)})
    views = dir_views(dirs, tags)
    for tag in tags:
        plan = cleanup_plan(views, tag, dirs)
        for d in dirs:
            mine = [x for x in plan if x[1].startswith(d + os.sep)]
            if delete:
                apply_plan(d, tag, [x for x in mine if x[0] != "keep"])
            done = {"remove": "removed", "restore": "restored", "keep": "keep"} if delete else {}
            for action, path, why in mine:
                rows.append({"dir": d, "kind": "leftover", "path": path, "state": done.get(action, action),
                             "why": why})
    for d in dirs:
        for f in stale_claims(d):
            if delete:
                os.unlink(f)
            rows.append({"dir": d, "kind": "claim", "path": f, "state": "removed" if delete else "remove",
                         "why": "the claim of a save that did not release it"})
    return rows
