"""The checkpoint layout without DeepSpeed (issues 11.1, 11.2, 11.6): a tag staged and switched into
place whole, every file and every metadata file verified, the refused tag never offered.

Tags are built with the real writer (:class:`RankWriter`, :func:`write_manifest`) plus two files
standing in for DeepSpeed's ``torch.save`` output; the end-to-end crash matrix with DeepSpeed is in
``tests/test_checkpoint_crash.py``.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from aidaptiv_ds.checkpoint import format as fmt
from aidaptiv_ds.checkpoint.format import IncompleteCheckpointError, complete_tags, locate_tag, offer_complete, \
    publish, read_manifest, recover, staging_dir, tag_dir
from aidaptiv_ds.checkpoint.reader import CheckpointReader
from aidaptiv_ds.checkpoint.writer import RankWriter, write_manifest

DS_FILES = ("zero_pp_rank_0_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")


def stage(save_dir: str, tag: str, value: float, world: int = 1, param: str = "w") -> str:
    """Write a complete tag into the staging directory (as a save does before the switch); its one parameter
    ``param``."""
    path = staging_dir(save_dir, tag)
    for name in DS_FILES:  # DeepSpeed's own files (written in place by torch.save, no fsync)
        os.makedirs(path, exist_ok=True)
        torch.save({"global_steps": int(value), "name": name}, os.path.join(path, name))
    for r in range(world):
        w = RankWriter(path, r, world)
        state = torch.full((3, 8), value)
        w.write_tensors("sg00000.safetensors", [("state", state)], {"aidaptiv": {"names": ["fp32", "a", "b"]}})
        w.finish({"subgroups": [{"names": ["fp32", "a", "b"], "numel": 8, "step": value, "step_type": "float",
                                 "file": "sg00000.safetensors",
                                 "params": [{"name": param, "ds_id": 0, "partition_numel": 8, "offset": 0, "numel": 8 * world,
                                             "shape": [8 * world], "dtype": "float32"}]}],
                  "frozen": [], "frozen_file": "frozen.safetensors", "loss_scaler": {}, "param_groups": [],
                  "optimizer": "AdamW"})
    write_manifest(path, world, {"tag": tag})
    return path


def save(save_dir: str, tag: str, value: float, world: int = 1) -> str:
    os.makedirs(save_dir, exist_ok=True)
    stage(save_dir, tag, value, world)
    return publish(save_dir, tag)


def loaded_value(save_dir: str, tag: str) -> float:
    r = CheckpointReader(locate_tag(save_dir, tag))
    return float(r.full("w", 1)[0])


@pytest.mark.parametrize("exchange", [True, False], ids=["rename-exchange", "two-renames"])
def test_a_save_over_an_existing_tag_switches_whole(tmp_path, monkeypatch, exchange):
    ck = str(tmp_path / "ck")
    assert save(ck, "last", 1.0) == "new"
    if not exchange:
        monkeypatch.setattr(fmt, "exchange", lambda a, b: False)
    assert save(ck, "last", 2.0) == ("exchanged" if exchange else "two renames")
    assert loaded_value(ck, "last") == 2.0
    assert sorted(os.listdir(ck)) == [".aidaptiv-retired", ".aidaptiv-staging", "last"] if not exchange else \
        sorted(os.listdir(ck)) == [".aidaptiv-staging", "last"]
    assert not os.listdir(os.path.join(ck, ".aidaptiv-staging"))


def test_a_crash_between_the_two_renames_loses_nothing(tmp_path, monkeypatch):
    """The filesystem cannot exchange: the old tag is set aside, then the new one renamed in. Cut
    between the two, the tag directory is missing; both complete copies are there, the new one is
    what a load finds, and the next save puts it back in place."""
    ck = str(tmp_path / "ck")
    save(ck, "last", 1.0)
    monkeypatch.setattr(fmt, "exchange", lambda a, b: False)
    stage(ck, "last", 2.0)

    class Cut(Exception):
        pass

    def kill(name):
        if name == "mid_switch":
            raise Cut

    with pytest.raises(Cut):
        publish(ck, "last", kill)
    assert not os.path.exists(tag_dir(ck, "last"))
    assert locate_tag(ck, "last") == staging_dir(ck, "last") and loaded_value(ck, "last") == 2.0
    assert recover(ck) == [f"restored {tag_dir(ck, 'last')} from {staging_dir(ck, 'last')}",
                           f"removed {fmt.retired_dir(ck, 'last')}"]
    assert loaded_value(ck, "last") == 2.0 and locate_tag(ck, "last") == tag_dir(ck, "last")


def test_an_interrupted_staging_is_removed_and_the_old_tag_kept(tmp_path):
    ck = str(tmp_path / "ck")
    save(ck, "last", 1.0)
    path = stage(ck, "last", 2.0)
    os.unlink(os.path.join(path, "aidaptiv", "MANIFEST.json"))   # killed before its manifest
    assert loaded_value(ck, "last") == 1.0
    assert recover(ck) == [f"removed {path}"]
    assert loaded_value(ck, "last") == 1.0


def _tag_files(ck, tag):
    path = tag_dir(ck, tag)
    return {"model_states": os.path.join(path, DS_FILES[0]), "rank.json": os.path.join(path, "aidaptiv", "rank00000",
            "rank.json"), "manifest": os.path.join(path, "aidaptiv", "MANIFEST.json")}


def test_a_flipped_byte_in_deepspeeds_file_is_named(tmp_path):
    """DeepSpeed's files are in the manifest: damage is refused by name, not an UnpicklingError."""
    ck = str(tmp_path / "ck")
    save(ck, "a", 1.0)
    p = _tag_files(ck, "a")["model_states"]
    with open(p, "r+b") as f:
        f.seek(40)
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 1]))
    read_manifest(tag_dir(ck, "a"))                               # same size: only the CRC tells
    with pytest.raises(IncompleteCheckpointError, match=f"the CRC32 of {p} does not match"):
        CheckpointReader(tag_dir(ck, "a"))


@pytest.mark.parametrize("which", ["rank.json", "manifest"])
def test_a_changed_value_in_a_metadata_file_is_refused(tmp_path, which):
    """The trial changed ``"step": 2.0`` to ``9.0`` in rank.json and it loaded; now both metadata
    files carry a CRC of their content, checked whenever the tag is opened."""
    ck = str(tmp_path / "ck")
    save(ck, "a", 2.0)
    p = _tag_files(ck, "a")[which]
    with open(p) as f:
        data = json.load(f)
    if which == "rank.json":
        data["subgroups"][0]["step"] = 9.0
    else:
        data["global_steps"] = 9
    text = json.dumps(data, indent=1, sort_keys=True)
    with open(p, "w") as f:
        f.write(text)
    with pytest.raises(IncompleteCheckpointError, match="does not match (its CRC32|the manifest)"):
        read_manifest(tag_dir(ck, "a"))
    assert complete_tags(ck) == []
    if which == "rank.json":  # its own CRC catches it too (a reader that opens it directly)
        with pytest.raises(IncompleteCheckpointError, match="does not match its CRC32"):
            fmt.read_rank_index(tag_dir(ck, "a"), 0)


def test_the_refused_tag_is_not_offered_and_the_previous_one_is(tmp_path):
    ck = str(tmp_path / "ck")
    save(ck, "global_step2", 2.0)
    save(ck, "global_step4", 4.0)
    p = os.path.join(tag_dir(ck, "global_step4"), "aidaptiv", "rank00000", "sg00000.safetensors")
    with open(p, "r+b") as f:
        f.seek(os.path.getsize(p) - 8)
        f.write(b"\xff" * 8)
    assert complete_tags(ck) == ["global_step2", "global_step4"]    # sizes are fine: CRC only on load
    msg = offer_complete(ck, "global_step4")
    assert "['global_step2']" in msg and "tag='global_step2'" in msg and "global_step4'" not in msg.split("Fix")[0]
    os.unlink(os.path.join(tag_dir(ck, "global_step2"), "aidaptiv", "MANIFEST.json"))
    assert "There is no other complete checkpoint" in offer_complete(ck, "global_step4")


def test_version_1_checkpoints_still_load(tmp_path):
    """A tag written before layout 2 (no self-CRCs, DeepSpeed's files not listed) is read as before."""
    ck = str(tmp_path / "ck")
    save(ck, "old", 3.0)
    base = os.path.join(tag_dir(ck, "old"), "aidaptiv")
    for p in (os.path.join(base, "rank00000", "rank.json"), os.path.join(base, "MANIFEST.json")):
        with open(p) as f:
            data = json.load(f)
        data.pop("self_crc32")
        if p.endswith("MANIFEST.json"):
            data.update(version=1, deepspeed_files={})
            data["files"]["rank00000/rank.json"] = {"crc32": None,
                                                    "bytes": os.path.getsize(os.path.join(base, "rank00000", "rank.json"))}
        else:
            data.pop("version")
        with open(p, "w") as f:
            json.dump(data, f)
    assert loaded_value(ck, "old") == 3.0


def test_cloned_sub_group_files_carry_a_crc(tmp_path, monkeypatch):
    """A sub-group shared with the slab by a copy-on-write clone (XFS, btrfs) gets its CRC by reading
    it back, so a load verifies it too (here the clone is emulated by copy_file_range)."""
    from aidaptiv_ds.checkpoint import writer as wmod

    def fake_clone(src_fd, src_off, dst_fd, dst_off, length):
        os.copy_file_range(src_fd, dst_fd, length, src_off, dst_off)
        return True

    monkeypatch.setattr(wmod, "clone_range", fake_clone)
    src = tmp_path / "slab"
    data = torch.arange(4096, dtype=torch.float32)
    src.write_bytes(data.numpy().tobytes())
    fd = os.open(src, os.O_RDONLY)
    try:
        w = RankWriter(str(tmp_path / "tag"), 0, 1)
        assert w.clone_tensor("sg00000.safetensors", "state", "float32", [1, 4096], [(fd, 0, 16384, 0)], None, 4096)
    finally:
        os.close(fd)
    info = w.files["rank00000/sg00000.safetensors"]
    assert info["crc32"] == fmt.crc32_file(os.path.join(w.dir, "sg00000.safetensors")) and info["bytes"] == 4096 + 16384
    from safetensors.torch import load_file
    assert torch.equal(load_file(os.path.join(w.dir, "sg00000.safetensors"))["state"][0], data)


def test_a_full_disk_during_a_sub_group_file_names_it_and_puts_nothing_in_place(tmp_path, monkeypatch):
    """Issue 11.7: the writer fsynced and renamed a sub-group file cut at 2.1 of 12.8 MB on a full
    disk, then failed with an OSError naming no path. Now every write is checked: the error names the
    file and the bytes written of the bytes expected, and no file of that name appears."""
    import errno

    from aidaptiv_ds.io import atomic
    from aidaptiv_ds.io.errors import FileWriteError

    real, left = os.pwrite, [2_100_000]

    def full(fd, data, off):
        n = min(len(data), left[0])
        if not n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        left[0] -= n
        return real(fd, memoryview(data)[:n], off)

    monkeypatch.setattr(atomic.os, "pwrite", full)
    w = RankWriter(str(tmp_path / "tag"), 0, 1)
    state = torch.zeros(3, 1_066_667)  # 12.8 MB
    with pytest.raises(FileWriteError) as e:
        w.write_tensors("sg00000.safetensors", [("state", state)])
    path = os.path.join(w.dir, "sg00000.safetensors")
    assert e.value.path == path and e.value.errno == errno.ENOSPC and e.value.written == 2_100_000
    assert f"{path} failed after 2100000 of {4096 + state.numel() * 4} bytes: No space left on device" in str(e.value)
    assert os.listdir(w.dir) == [] and w.files == {}


def test_a_checkpoint_of_deepspeeds_own_offload_is_named_as_such(tmp_path):
    """A tag DeepSpeed's own offload saved (its files, no ``aidaptiv/``) is not called incomplete or damaged (a
    user who switched a CPU-offload project met that): the error says who saved it and how to start from it."""
    tag = tmp_path / "global_step4"
    tag.mkdir()
    (tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"x")
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    with pytest.raises(IncompleteCheckpointError, match="saved by DeepSpeed's own ZeRO offload") as e:
        read_manifest(str(tag))
    assert "zero_to_fp32.py" in str(e.value) and "incomplete" not in str(e.value)
    assert isinstance(e.value, fmt.ForeignCheckpointError)  # complete: load_checkpoint offers no other tag for it
    (tmp_path / "model.safetensors").write_bytes(b"x")  # HF Trainer's checkpoint-N: its weights beside the tag
    with pytest.raises(fmt.ForeignCheckpointError, match=r"from_pretrained\(.*model.safetensors") as e:
        read_manifest(str(tag))
    assert "zero_to_fp32" not in str(e.value)
    (tag / "aidaptiv").mkdir()  # our directory without its manifest: an unfinished save of ours
    with pytest.raises(IncompleteCheckpointError, match="is incomplete"):
        read_manifest(str(tag))


def test_export_of_a_peft_checkpoint_is_refused_before_writing(tmp_path):
    """A LoRA run's checkpoint (PEFT's ``base_model.model.`` names, the base left out by HF's save) exported as an HF
    model directory loaded as a randomly initialised model (a new-user trial): refused, naming the fix."""
    from aidaptiv_ds.checkpoint.export import export_hf

    ck = str(tmp_path / "ck")
    os.makedirs(ck)
    stage(ck, "global_step1", 1.0, param="base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    publish(ck, "global_step1")
    with pytest.raises(ValueError, match="holds a PEFT model's parameters .* 1 LoRA tensors of 1.*save_pretrained"):
        export_hf(os.path.join(ck, "global_step1"), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_a_deepspeed_file_reference_reads_only_its_own_save(tmp_path):
    """The references DeepSpeed's ``.pt`` files hold ([Note: what zero_to_fp32 reads]) map the tensor from the tag's
    own files, and only where that tag's manifest lists the ``.pt`` (size and CRC32): a ``.pt`` copied away from its
    ``aidaptiv/`` directory, its tag saved over since, is refused, not read from the newer save."""
    import shutil

    from aidaptiv_ds.checkpoint.deepspeed_compat import SavedTensorRef

    ck = str(tmp_path / "ck")
    tag = os.path.join(ck, "t")
    for value in (3.0, 5.0):
        path = stage(ck, "t", value)
        torch.save({"w": SavedTensorRef(0, "sg00000.safetensors", "state", 1), "saved": value},
                   os.path.join(path, "refs_optim_states.pt"))
        write_manifest(path, 1, {"tag": "t"})  # lists the .pt with its CRC
        publish(ck, "t")
        if value == 3.0:
            os.makedirs(tmp_path / "copy")
            shutil.copy(os.path.join(tag, "refs_optim_states.pt"), tmp_path / "copy")
            row = torch.load(os.path.join(tag, "refs_optim_states.pt"), weights_only=False)["w"]
            assert row.dtype == torch.float32 and row.shape == (8,) and bool((row == 3.0).all())
    assert bool((torch.load(os.path.join(tag, "refs_optim_states.pt"), weights_only=False)["w"] == 5.0).all())
    with pytest.raises(FileNotFoundError, match="of the save that wrote it, not found beside it"):
        torch.load(str(tmp_path / "copy" / "refs_optim_states.pt"), weights_only=False)


def test_a_file_of_many_references_parses_the_manifest_and_header_once(tmp_path):
    """A rank's ``.pt`` holds a reference per sub-group, moment and frozen tensor (thousands on a large model):
    unpickling it parses the tag's manifest and each safetensors header once, not once per reference."""
    from aidaptiv_ds.checkpoint import deepspeed_compat as dc

    ck = str(tmp_path / "ck")
    path = stage(ck, "t", 7.0)
    refs = [dc.SavedTensorRef(0, "sg00000.safetensors", "state", i % 3) for i in range(60)]
    torch.save({"refs": refs}, os.path.join(path, "refs_optim_states.pt"))
    write_manifest(path, 1, {"tag": "t"})
    publish(ck, "t")
    tag = os.path.join(ck, "t")
    manifests, headers = dc._deepspeed_files.cache_info().misses, dc._header.cache_info().misses
    rows = torch.load(os.path.join(tag, "refs_optim_states.pt"), weights_only=False)["refs"]
    assert len(rows) == 60 and all(bool((r == 7.0).all()) for r in rows)
    assert dc._deepspeed_files.cache_info().misses - manifests == 1
    assert dc._header.cache_info().misses - headers == 1


def test_a_read_of_the_first_slots_reads_those_rows_only(tmp_path, monkeypatch):
    """A weights-only load reads the master row alone (``slots=1``), a third of the bytes with Adam's two moments;
    the rows it returns are those of a whole read."""
    path = staging_dir(str(tmp_path), "t")
    w = RankWriter(path, 0, 1)
    state = torch.arange(24, dtype=torch.float32).reshape(3, 8)  # master, exp_avg, exp_avg_sq: distinct rows
    w.write_tensors("sg00000.safetensors", [("state", state)], {"aidaptiv": {"names": ["fp32", "a", "b"]}})
    w.finish({"subgroups": [{"names": ["fp32", "a", "b"], "numel": 8, "step": 1, "step_type": "float",
                             "file": "sg00000.safetensors",
                             "params": [{"name": "w", "ds_id": 0, "partition_numel": 8, "offset": 0, "numel": 8,
                                         "shape": [8], "dtype": "float32"}]}],
              "frozen": [], "frozen_file": "frozen.safetensors", "loss_scaler": {}, "param_groups": [],
              "optimizer": "AdamW"})
    write_manifest(path, 1, {"tag": "t"})
    r = CheckpointReader(path)
    whole = r.read_range("w", 0, 8)
    assert torch.equal(whole, state)
    assert torch.equal(r.read_range("w", 2, 6, slots=1), state[:1, 2:8])
    assert torch.equal(r.full("w", 1), state[1]) and torch.equal(r.full("w"), state[0])
