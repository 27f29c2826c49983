"""Node-local checkpoint parts without DeepSpeed (issue 40): who shares a directory, the commit across
nodes under crashes at every point, what a load accepts and refuses, ``export`` and ``gc`` over parts.

Two "nodes" are two directories; each step of :mod:`aidaptiv_ds.checkpoint.parts` runs per node in
the order ``aidaptiv_ds.integration.checkpointing._commit_parts`` runs it, with the ranks agreeing
between steps. Tags are written with the real writer (:class:`RankWriter`) plus a file standing in
for DeepSpeed's ``torch.save`` output. The end-to-end runs (DeepSpeed, two network namespaces, a
``kill -9`` of one node) are in ``tests/test_two_nodes.py``.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil

import pytest
import torch

from aidaptiv_ds.checkpoint import parts as P
from aidaptiv_ds.checkpoint.format import COMMIT, DIRNAME, RETIRED, IncompleteCheckpointError, staging_dir, tag_dir
from aidaptiv_ds.checkpoint.reader import CheckpointReader
from aidaptiv_ds.checkpoint.writer import RankWriter

WORLD = 2
HOSTS = ("node0", "node1")


# ---------------------------------------------------------------------------------------------- building saves
def stage_rank(save_dir: str, tag: str, rank: int, value: float) -> None:
    """Rank ``rank``'s files of a save: a DeepSpeed stand-in and one sub-group whose elements are
    ``value + rank`` (so a mix of saves or ranks shows in the values read back)."""
    path = staging_dir(save_dir, tag)
    os.makedirs(path, exist_ok=True)
    torch.save({"global_steps": int(value)}, os.path.join(path, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
    w = RankWriter(path, rank, WORLD)
    w.write_tensors("sg00000.safetensors", [("state", torch.full((3, 8), value + rank))],
                    {"aidaptiv": {"names": ["fp32", "a", "b"]}})
    w.finish({"subgroups": [{"names": ["fp32", "a", "b"], "numel": 8, "step": value, "step_type": "float",
                             "file": "sg00000.safetensors",
                             "params": [{"name": "w", "ds_id": 0, "partition_numel": 8, "offset": 0,
                                         "numel": 8 * WORLD, "shape": [8 * WORLD], "dtype": "float32"}]}],
              "frozen": [], "frozen_file": "frozen.safetensors", "loss_scaler": {}, "param_groups": [],
              "optimizer": "AdamW"})


class Crash(Exception):
    """A node stops here (``kill -9``): nothing after this point of its sequence runs."""


class Node:
    """One node (one rank, one directory) going through the steps of a save; ``limit`` kill points
    into the current step it crashes (None: it never does)."""

    def __init__(self, index: int, save_dir: str) -> None:
        self.index, self.save_dir, self.limit, self.seen, self.dead = index, save_dir, None, 0, False

    def kp(self, name: str) -> None:
        self.seen += 1
        if self.limit is not None and self.seen > self.limit:
            self.dead = True
            raise Crash(f"node {self.index} at {name}")


def layout(dirs: list[str]) -> list[P.Part]:
    return [P.Part(i, (i,), HOSTS[i], os.path.abspath(d)) for i, d in enumerate(dirs)]


def views_of(dirs: list[str], tags) -> list[dict]:
    return [P.rank_view(d, list(tags), r, HOSTS[r]) for r, d in enumerate(dirs)]


def recover(dirs: list[str]) -> list[str]:
    """What a save's first step does on every part (integration ``_recover_parts``)."""
    tags = sorted({t for d in dirs for t in P.leftover_tags(d)})
    views = views_of(dirs, tags)
    done = []
    for tag in tags:
        for d in dirs:
            done += P.apply_plan(d, tag, P.cleanup_plan(views, tag, [d], world=WORLD))
    return done


def save_steps(dirs: list[str], tag: str, value: float, save_id: str) -> list:
    """The steps of a save in parts, as ``[(who, fn(node))]`` per step; every node finishes a step before
    any starts the next (the ranks agree between steps)."""
    parts = layout(dirs)
    crcs: dict[int, int] = {}
    record: dict = {}

    def stage(n: Node) -> None:
        n.kp("before_deepspeed")
        shutil.rmtree(staging_dir(n.save_dir, tag), ignore_errors=True)
        stage_rank(n.save_dir, tag, n.index, value)
        n.kp("after_rank_state")

    def prepare(n: Node) -> None:
        n.kp("before_manifest")
        crcs[n.index] = P.prepare_part(staging_dir(n.save_dir, tag), WORLD, {"tag": tag, "global_steps": int(value),
                                                                             "save_id": save_id},
                                       parts[n.index], parts)
        n.kp("before_switch")

    def switch(n: Node) -> None:
        P.switch_part(n.save_dir, tag, n.kp)

    def commit(n: Node) -> None:
        record.update(P.commit_record(tag, save_id, WORLD, int(value), parts, [crcs[0], crcs[1]]))
        n.kp("before_commit")
        P.write_commit(tag_dir(n.save_dir, tag), record)
        n.kp("after_commit")

    def finish(n: Node) -> None:
        P.finish_part(n.save_dir, tag, None if n.index == 0 else record, True, n.kp)

    return [("all", stage), ("all", prepare), ("all", switch), ("rank0", commit), ("all", finish)]


def run_save(dirs: list[str], tag: str, value: float, save_id: str, crash: dict | None = None) -> None:
    """Run a save; ``crash = {"step": s, 0: n0, 1: n1}`` stops node i after ``n_i`` kill points of step s
    (None: it completes the step) and nothing runs after step s (a node that lives on blocks at the
    ranks' agreement and dies of its peer's loss)."""
    nodes = [Node(i, d) for i, d in enumerate(dirs)]
    for s, (who, fn) in enumerate(save_steps(dirs, tag, value, save_id)):
        for n in nodes:
            if who == "rank0" and n.index != 0:
                continue
            n.seen, n.limit = 0, (crash.get(n.index) if crash and crash["step"] == s else None)
            try:
                fn(n)
            except Crash:
                pass
            assert n.limit is None or n.dead, f"node {n.index} passed only {n.seen} kill points of step {s}"
        if crash and crash["step"] == s:
            return


def loaded(dirs: list[str], tag: str | None = None) -> tuple[str, list[float]]:
    """What a load on both nodes takes: the tag and, per rank, the value of its partition."""
    views = views_of(dirs, [tag] if tag else [])
    if tag is None:  # as the load does: a second round with the tags the ranks' latest files name
        views = views_of(dirs, sorted({v["latest"] for v in views} - {None}))
    t = P.choose_tag(views, tag)
    d = P.decide(views, t, WORLD)
    vals = []
    for r in range(WORLD):
        reader = CheckpointReader(d.paths[r], require_all=False)
        vals.append(float(reader.read_range("w", 8 * r, 8)[0, 0]) - r)
        assert torch.equal(reader.read_range("w", 8 * r, 8), torch.full((3, 8), vals[-1] + r))
    return t, vals


# ---------------------------------------------------------------------------------------------- who shares a directory
def test_claims_group_the_ranks_that_see_one_directory(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    os.makedirs(a)
    os.makedirs(b)
    os.symlink(a, str(tmp_path / "a-link"))
    seen = [P.claim(a, "t1", 0), P.claim(str(tmp_path / "a-link"), "t1", 1), P.claim(b, "t1", 2), P.claim(a, "t1", 3)]
    assert seen == [0, 0, 2, 0]  # another path to the same directory is the same directory
    parts = P.group_parts([(o, f"h{r}", p) for r, (o, p) in enumerate(zip(seen, [a, a, b, a]))])
    assert [(p.index, p.ranks, p.host, p.leader) for p in parts] == [(0, (0, 1, 3), "h0", 0), (1, (2,), "h2", 2)]
    assert sorted(os.listdir(a)) == [P.CLAIM + "t1"]  # only the claim itself stays, until the leader releases it
    P.release_claim(a, "t1")
    P.release_claim(b, "t1")
    assert os.listdir(a) == [] and os.listdir(b) == []
    with pytest.raises(ValueError, match="claimed another directory"):
        P.group_parts([(1, "h0", a), (0, "h1", b)])


def test_a_directory_that_cannot_be_claimed_is_named(tmp_path):
    from aidaptiv_ds.io.errors import FileWriteError
    with pytest.raises(FileWriteError, match=str(tmp_path / "missing")):
        P.claim(str(tmp_path / "missing"), "t", 0)


# ---------------------------------------------------------------------------------------------- a whole save
def test_a_save_in_parts_leaves_one_part_per_node_with_a_commit_record(tmp_path):
    dirs = [str(tmp_path / h) for h in HOSTS]
    run_save(dirs, "global_step2", 2.0, "s2")
    for r, d in enumerate(dirs):
        assert sorted(os.listdir(d)) == ["global_step2", "latest"]  # no staging or set-aside directory left
        assert sorted(os.listdir(os.path.join(d, "global_step2", DIRNAME))) == [COMMIT, "MANIFEST.json",
                                                                                  f"rank0000{r}"]
    recs = [json.load(open(os.path.join(d, "global_step2", DIRNAME, COMMIT))) for d in dirs]
    assert recs[0] == recs[1] and [p["ranks"] for p in recs[0]["parts"]] == [[0], [1]]
    assert loaded(dirs) == ("global_step2", [2.0, 2.0])
    # each part alone reads its own rank's elements; the other rank's are named as another node's part
    r0 = CheckpointReader(tag_dir(dirs[0], "global_step2"), require_all=False)
    with pytest.raises(IncompleteCheckpointError, match=r"part of node node1 \(ranks \[1\]\), which it saved to "):
        r0.read_range("w", 8, 8)
    with pytest.raises(IncompleteCheckpointError, match="lacks the state of ranks"):
        CheckpointReader(tag_dir(dirs[0], "global_step2"))
    whole = CheckpointReader([tag_dir(d, "global_step2") for d in dirs])
    assert torch.equal(whole.full("w", 0), torch.tensor([2.0] * 8 + [3.0] * 8))


# ---------------------------------------------------------------------------------------------- crashes
#: kill points per step of a save (stage, prepare, switch, commit, finish); the switch of a tag that
#: exists has two (between and after its renames), of a new tag one
POINTS = {"new-tag": [2, 2, 1, 2, 2], "same-tag": [2, 2, 2, 2, 2]}


def _scenarios(kind: str):
    """Every step of a save, and within it every pair of crash points of the two nodes (i: at the
    step's i-th kill point, None: it completes the step; not both None, which is the next step's
    start). The commit step runs on rank 0 only."""
    for step, k in enumerate(POINTS[kind]):
        n0 = list(range(k)) + [None]
        n1 = [None] if step == 3 else list(range(k)) + [None]
        for a, b in itertools.product(n0, n1):
            if a is None and b is None:
                continue
            yield step, a, b


@pytest.fixture
def no_fsync(monkeypatch):
    """The crashes here are stops of a node's sequence of steps, not power cuts: ``fsync`` (9,000 calls
    in the matrix, 3 ms each on a virtual disk) is skipped. Durability per file and directory is the
    writer's, tested with real crashes in tests/test_checkpoint_crash.py and tests/test_atomic.py."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


@pytest.mark.parametrize("kind", ["new-tag", "same-tag"])
def test_a_crash_of_any_node_at_any_point_leaves_a_loadable_save(tmp_path, kind, no_fsync):
    """The previous save was committed (value 1). The next save (value 2, the same tag or a new one) is
    cut at every pair of crash points of the two nodes within each of its steps. Afterwards a load on
    both nodes takes one save whole: the new one once rank 0's commit record exists, else the old one
    -- never a mix, never nothing. The next save's clean-up keeps that, and a save after it works."""
    old_tag, new_tag = ("last", "last") if kind == "same-tag" else ("global_step1", "global_step2")
    n = 0
    for step, a, b in _scenarios(kind):
        root = tmp_path / f"{step}-{a}-{b}"
        dirs = [str(root / h) for h in HOSTS]
        run_save(dirs, old_tag, 1.0, "old")
        run_save(dirs, new_tag, 2.0, "new", crash={"step": step, 0: a, 1: b})
        rec = os.path.join(tag_dir(dirs[0], new_tag), DIRNAME, COMMIT)
        committed = os.path.isfile(rec) and json.load(open(rec))["save_id"] == "new"  # rank 0's commit of the new save
        named = {P.rank_view(d, [], 0, "x")["latest"] for d in dirs}
        # a load without a tag follows `latest`: the new save once committed and named by a node's latest
        want = 2.0 if committed and (kind == "same-tag" or new_tag in named) else 1.0
        tag, vals = loaded(dirs)
        assert vals == [want, want], (step, a, b, tag, vals)
        if committed:
            assert loaded(dirs, new_tag)[1] == [2.0, 2.0]
        if kind == "new-tag":
            assert loaded(dirs, old_tag)[1] == [1.0, 1.0]  # the old tag is untouched either way
            if not committed and any(os.path.isdir(tag_dir(d, new_tag)) for d in dirs):
                with pytest.raises(IncompleteCheckpointError, match="no commit record on any node"):
                    loaded(dirs, new_tag)
        recover(dirs)  # the next save's first step
        assert [P.leftover_tags(d) for d in dirs] == [[], []]
        assert loaded(dirs)[1] == [want, want]
        if kind == "same-tag":
            for d in dirs:
                assert P.inspect_tag(d, new_tag)[0]["save_id"] == ("new" if committed else "old")
        run_save(dirs, "after", 3.0, "after")
        assert loaded(dirs) == ("after", [3.0, 3.0])
        n += 1
    assert n == {"new-tag": 29, "same-tag": 34}[kind]


def test_latest_files_that_differ_take_the_newest_save_loadable_everywhere(tmp_path):
    dirs = [str(tmp_path / h) for h in HOSTS]
    run_save(dirs, "global_step1", 1.0, "s1")
    run_save(dirs, "global_step2", 2.0, "s2", crash={"step": 4, 0: None, 1: 0})  # node 1 died before its latest
    assert [P.rank_view(d, [], 0, "x")["latest"] for d in dirs] == ["global_step2", "global_step1"]
    assert loaded(dirs) == ("global_step2", [2.0, 2.0])
    os.unlink(os.path.join(dirs[1], "latest"))  # no latest on one node: the other's tag, found everywhere
    assert loaded(dirs) == ("global_step2", [2.0, 2.0])


# ---------------------------------------------------------------------------------------------- refusals
@pytest.fixture
def two_saves(tmp_path):
    dirs = [str(tmp_path / h) for h in HOSTS]
    other = [str(tmp_path / f"other-{h}") for h in HOSTS]
    run_save(dirs, "global_step2", 2.0, "mine")
    run_save(other, "global_step2", 5.0, "theirs")
    return dirs, other


def test_a_missing_part_is_refused_naming_the_node_and_path(two_saves):
    dirs, _ = two_saves
    shutil.rmtree(tag_dir(dirs[1], "global_step2"))
    with pytest.raises(IncompleteCheckpointError) as e:
        loaded(dirs)
    msg = str(e.value)
    assert f"node node1 (rank 1): {tag_dir(dirs[1], 'global_step2')} is missing" in msg
    assert "node0" not in msg.split("is not complete on every node")[1]  # only the node at fault is named


def test_a_node_whose_directory_is_gone_is_named(two_saves):
    """Node 1's disk was replaced: no part and no ``latest`` there; node 0's ``latest`` names the tag."""
    dirs, _ = two_saves
    shutil.rmtree(dirs[1])
    with pytest.raises(IncompleteCheckpointError, match=r"node node1 \(rank 1\): .*node1/global_step2 is missing"):
        loaded(dirs)


def test_a_part_from_another_save_is_refused_naming_the_node_and_path(two_saves):
    dirs, other = two_saves
    shutil.rmtree(tag_dir(dirs[1], "global_step2"))
    shutil.copytree(tag_dir(other[1], "global_step2"), tag_dir(dirs[1], "global_step2"))
    with pytest.raises(IncompleteCheckpointError) as e:
        loaded(dirs)
    msg = str(e.value)
    assert "the nodes hold parts of different saves of checkpoint 'global_step2'" in msg
    assert f"node node1 (rank 1): {tag_dir(dirs[1], 'global_step2')} holds save theirs (step 5, committed " in msg
    assert f"node node0 (rank 0): {tag_dir(dirs[0], 'global_step2')} holds save mine (step 2, committed " in msg


def test_a_damaged_or_incomplete_part_is_refused_naming_the_node(two_saves):
    dirs, _ = two_saves
    os.unlink(os.path.join(tag_dir(dirs[1], "global_step2"), DIRNAME, "rank00001", "rank.json"))
    with pytest.raises(IncompleteCheckpointError, match=r"node node1 \(rank 1\): .*global_step2 is incomplete or "
                                                        r"damaged: .*rank00001/rank\.json should hold \d+ bytes, "
                                                        r"found no such file"):
        loaded(dirs)


def test_ranks_that_moved_between_nodes_are_refused(two_saves):
    dirs, _ = two_saves
    with pytest.raises(IncompleteCheckpointError, match=r"holds the part of ranks \[1\], not rank 0 \(the ranks moved "
                                                        r"between nodes"):
        loaded(list(reversed(dirs)))


def test_whole_checkpoint_copies_must_be_the_same_save(tmp_path):
    """The one-directory layout read through a copy per node: each rank reads its node's copy, but
    all must hold the same save, and a rank without the tag is named (no rank resumes from nothing)."""
    from aidaptiv_ds.checkpoint.format import publish
    from aidaptiv_ds.checkpoint.writer import write_manifest

    dirs = [str(tmp_path / h) for h in HOSTS]
    for d, sid, value in zip(dirs, ("a", "b"), (1.0, 4.0)):
        for r in range(WORLD):
            stage_rank(d, "t", r, value)
        write_manifest(staging_dir(d, "t"), WORLD, {"tag": "t", "save_id": sid})
        publish(d, "t")
    with pytest.raises(IncompleteCheckpointError, match="the ranks see different saves of checkpoint 't'"):
        P.decide(views_of(dirs, ["t"]), "t")
    shutil.rmtree(tag_dir(dirs[1], "t"))
    with pytest.raises(IncompleteCheckpointError, match=r"node node1 \(rank 1\): .*t is missing.*The other ranks "
                                                        r"found it complete"):
        P.decide(views_of(dirs, ["t"]), "t")
    d = P.decide(views_of([dirs[0], dirs[0]], ["t"]), "t")
    assert d.loadable and not d.parts and d.paths == [tag_dir(dirs[0], "t")] * 2


# ---------------------------------------------------------------------------------------------- export and gc
def test_export_gathers_the_parts_named_on_the_command_line(tmp_path, two_saves, capsys):
    from aidaptiv_ds.cli.main import main as cli

    dirs, _ = two_saves
    out = str(tmp_path / "hf")
    assert cli(["export", dirs[0], "--output", out]) == 1
    err = capsys.readouterr().err
    assert "aidaptiv-ds export: error:" in err and f"the part of node node1 (ranks [1]), which it saved to {dirs[1]} " \
        "on that node, is not among the directories given" in err
    assert not os.path.exists(out)  # refused before anything was written
    src = str(_fake_source(tmp_path))
    assert cli(["export", dirs[0], dirs[1], "--output", out, "--source", src]) == 0
    from safetensors.torch import load_file
    assert torch.equal(load_file(os.path.join(out, "model.safetensors"))["w"], torch.tensor([2.0] * 8 + [3.0] * 8))
    # a tag directory of each node works too; a part of another save is named
    assert cli(["export", tag_dir(dirs[1], "global_step2"), tag_dir(dirs[0], "global_step2"), "--output", out,
                "--source", src]) == 0
    assert cli(["export", dirs[0], str(tmp_path / "other-node1"), "--output", out, "--source", src]) == 1
    assert "the nodes hold parts of different saves" in capsys.readouterr().err


def _fake_source(tmp_path):
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "config.json").write_text(json.dumps({"model_type": "test"}))
    return src


def test_gc_lists_and_removes_what_interrupted_saves_left_on_each_node(tmp_path, capsys):
    from aidaptiv_ds.cli.main import main as cli

    dirs = [str(tmp_path / h) for h in HOSTS]
    run_save(dirs, "last", 1.0, "old")
    run_save(dirs, "last", 2.0, "new", crash={"step": 2, 0: None, 1: 0})  # node 1 cut between its two renames
    assert os.path.isdir(os.path.join(dirs[0], RETIRED, "last"))
    # one node alone: node 0's new part is in place but uncommitted, its old part set aside is needed
    assert cli(["gc", "--checkpoint", dirs[0]]) == 0
    text = capsys.readouterr().out
    assert "keep" in text and os.path.join(dirs[0], RETIRED, "last") in text
    assert cli(["gc", "--checkpoint", dirs[0], "--delete"]) == 0
    assert os.path.isdir(os.path.join(dirs[0], RETIRED, "last"))  # kept: undecidable from one node
    # both nodes' directories: the committed old save goes back into place on both
    assert cli(["gc", "--checkpoint", dirs[0], "--checkpoint", dirs[1], "--delete"]) == 0
    text = capsys.readouterr().out
    assert "restored" in text
    for d in dirs:
        assert sorted(os.listdir(d)) == ["last", "latest"]
    assert loaded(dirs) == ("last", [1.0, 1.0])
