"""Checkpoint, resume and export: nothing lost (issue 6).

* resume oracle: 6 steps straight == 3 steps, save, a fresh process loads, 3 more steps (bf16, Adam,
  1 and 2 ranks): losses, parameters and fp32 masters bit-identical;
* resume with another world size (2 -> 1, 1 -> 2): the loaded state, saved again at the new world
  size, consolidates to exactly the same tensors (masters and both Adam moments);
* a partial checkpoint is named, never loaded, and the error offers the complete ones (the crash
  matrix, ``kill -9`` at every point of a save, is in ``tests/test_checkpoint_crash.py``);
* export: HF safetensors that ``from_pretrained`` reloads, equal to DeepSpeed's ``save_16bit_model``
  and to the fp32 masters.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from _oracle import REPO, SCRIPT, free_port, run

from aidaptiv_ds.checkpoint.format import IncompleteCheckpointError, read_manifest
from aidaptiv_ds.checkpoint.reader import CheckpointReader

pytestmark = pytest.mark.subprocess  # every test here starts a child process (tests/conftest.py)

ARGS = ["--model", "llama", "--dtype", "bf16", "--steps", "6", "--budget", "0"]


def run_ws(ws: int, args: list[str], workdir: str, env: dict | None = None) -> dict:
    """Like :func:`_oracle.run` for the aidaptiv backend, through torchrun when ``ws > 1``."""
    if ws == 1:
        return run("aidaptiv", args, workdir, env=env)
    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, "aidaptiv.pt")
    e = dict(os.environ, PYTHONPATH=REPO, **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ws), "--master_port",
           str(free_port()), SCRIPT, "--backend", "aidaptiv", "--cache", os.path.join(workdir, "cache"), "--out", out,
           *args]
    p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-6000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("ws", [1, 2])
def test_resume_is_bit_identical(ws, tmp_path):
    straight = run_ws(ws, ARGS, str(tmp_path / "straight"))
    ck = str(tmp_path / "ckpt")
    first = run_ws(ws, ARGS + ["--save_after", "3", "--ckpt_dir", ck], str(tmp_path / "a"))
    assert first["losses"] == straight["losses"][:3]
    second = run_ws(ws, ARGS + ["--resume", "--ckpt_dir", ck], str(tmp_path / "b"))
    assert second["losses"] == straight["losses"][3:]
    for name, t in straight["params"].items():
        assert torch.equal(t, second["params"][name]), name
    for a, b in zip(straight["masters"], second["masters"]):
        assert torch.equal(a, b)


def test_a_save_dir_per_rank_saves_parts_and_resumes_bit_identical(tmp_path):
    """Node-local checkpoints on one machine (issue 40; with two real network namespaces:
    tests/test_two_nodes.py): with a save_dir per rank, as with a directory per node, each rank writes
    its part and its own ``latest``; a resume is bit-identical; one with another world size is refused
    with the fix."""
    straight = run_ws(2, ARGS, str(tmp_path / "straight"))
    ck = str(tmp_path / "ck{rank}")
    run_ws(2, ARGS + ["--save_after", "3", "--ckpt_dir", ck], str(tmp_path / "a"))
    for r in range(2):
        man = read_manifest(os.path.join(str(tmp_path / f"ck{r}"), "global_step3"))
        assert man["part"]["ranks"] == [r] and man["part"]["count"] == 2
        assert open(os.path.join(str(tmp_path / f"ck{r}"), "latest")).read() == "global_step3"
    second = run_ws(2, ARGS + ["--resume", "--ckpt_dir", ck], str(tmp_path / "b"))
    assert second["losses"] == straight["losses"][3:]
    for name, t in straight["params"].items():
        assert torch.equal(t, second["params"][name]), name
    for a, b in zip(straight["masters"], second["masters"]):
        assert torch.equal(a, b)
    with pytest.raises(AssertionError) as e:
        run_ws(1, ARGS + ["--resume", "--ckpt_dir", ck], str(tmp_path / "c"))
    assert "was written by 2 ranks and this job has 1" in str(e.value) and "export" in str(e.value)


def _consolidated(tag_path: str) -> dict[str, torch.Tensor]:
    r = CheckpointReader(tag_path)
    out = {n: r.read_range(n, 0, info.numel) for n, info in r.params.items()}
    assert r.state_names == ["exp_avg", "exp_avg_sq"]
    return out


@pytest.mark.parametrize("src,dst", [(2, 1), (1, 2)])
def test_resume_with_another_world_size(src, dst, tmp_path):
    args = ["--model", "llama", "--dtype", "bf16", "--steps", "6", "--ga", "2"]
    ck1, ck2 = str(tmp_path / "c1"), str(tmp_path / "c2")
    run_ws(src, args + ["--save_after", "3", "--ckpt_dir", ck1], str(tmp_path / "a"))
    # load at the new world size and save again at once: the state must consolidate to the same tensors
    run_ws(dst, args + ["--resume", "--ckpt_dir", ck1, "--save_after", "3", "--save_dir", ck2], str(tmp_path / "b"))
    assert read_manifest(os.path.join(ck2, "global_step3"))["world_size"] == dst
    a, b = _consolidated(os.path.join(ck1, "global_step3")), _consolidated(os.path.join(ck2, "global_step3"))
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n
    # and training goes on from there
    cont = run_ws(dst, args + ["--resume", "--ckpt_dir", ck1], str(tmp_path / "c"))
    assert len(cont["losses"]) == 3 and all(x == x for step in cont["losses"] for x in step)


def test_a_refused_checkpoint_is_named_and_only_complete_ones_are_offered(tmp_path):
    """Issue 11.2: the newest tag is refused (damaged: a flipped byte, same size; or incomplete: no
    manifest); the error names it, offers the previous complete tag -- not the refused one -- and
    that previous tag is still there and loads."""
    ck = str(tmp_path / "ckpt")
    args = ["--model", "llama", "--dtype", "bf16", "--steps", "3", "--ckpt_dir", ck]
    run("aidaptiv", args + ["--save_at", "1,2"], str(tmp_path / "a"))
    sg = os.path.join(ck, "global_step2", "aidaptiv", "rank00000", "sg00000.safetensors")
    with open(sg, "r+b") as f:
        f.seek(os.path.getsize(sg) - 100)
        f.write(b"\xff" * 8)
    with pytest.raises(IncompleteCheckpointError, match="CRC32"):
        CheckpointReader(os.path.join(ck, "global_step2"))
    for case in ("damaged", "incomplete"):
        if case == "incomplete":
            os.unlink(os.path.join(ck, "global_step2", "aidaptiv", "MANIFEST.json"))
        with pytest.raises(AssertionError) as e:
            run("aidaptiv", args + ["--resume"], str(tmp_path / f"b_{case}"))
        err = [ln for ln in str(e.value).splitlines() if "IncompleteCheckpointError: " in ln][-1]
        assert f"global_step2 is {case}" in err, err
        assert "Complete checkpoints in" in err and "['global_step1']" in err and "tag='global_step1'" in err, err
    with open(os.path.join(ck, "latest"), "w") as f:
        f.write("global_step1")
    assert len(run("aidaptiv", args + ["--resume"], str(tmp_path / "c"))["losses"]) == 2


def test_export_round_trip(tmp_path):
    """Exported fp32 = the fp32 masters; exported bf16 = DeepSpeed's gathered 16-bit weights; both reload in HF."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from aidaptiv_ds.cli.main import main as cli

    ck, s16 = str(tmp_path / "ckpt"), str(tmp_path / "s16")
    res = run("aidaptiv", ["--model", "llama", "--dtype", "bf16", "--steps", "3", "--ckpt_dir", ck, "--save_after",
                           "3", "--save16", s16], str(tmp_path / "a"))
    assert cli(["export", ck, "--output", str(tmp_path / "hf32"), "--dtype", "fp32"]) == 0
    assert cli(["export", ck, "--output", str(tmp_path / "hf16"), "--dtype", "bf16", "--shard-size", "1MB"]) == 0
    ds16 = load_file(os.path.join(s16, "model.safetensors")) if os.path.exists(os.path.join(s16, "model.safetensors")) \
        else torch.load(os.path.join(s16, "pytorch_model.bin"), weights_only=False)
    m32 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf32"), torch_dtype=torch.float32)
    m16 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf16"), torch_dtype=torch.bfloat16)
    sd32, sd16 = dict(m32.named_parameters()), dict(m16.named_parameters())
    flat = torch.cat([sd32[n].detach().reshape(-1) for n in res["params"]])
    assert torch.equal(flat, res["masters"][0][: flat.numel()])
    for n, t in ds16.items():
        if n in sd16:
            assert torch.equal(sd16[n].detach(), t), n
    assert len([f for f in os.listdir(tmp_path / "hf16") if f.endswith(".safetensors")]) > 1


def test_deepspeeds_zero_to_fp32_reads_our_checkpoint(tmp_path):
    """DeepSpeed's own converter (``get_fp32_state_dict_from_zero_checkpoint``, which fails on its NVMe-offload
    checkpoints, seams §6.3) reads ours: every parameter equal to the fp32 masters our reader and ``aidaptiv-ds
    export`` take ([Note: what zero_to_fp32 reads] in ``checkpoint/deepspeed_compat.py``)."""
    ck = str(tmp_path / "ckpt")
    run("aidaptiv", ["--model", "llama", "--dtype", "bf16", "--steps", "2", "--ckpt_dir", ck, "--save_after", "2"],
        str(tmp_path / "a"))
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    sd = get_fp32_state_dict_from_zero_checkpoint(ck, tag="global_step2")
    r = CheckpointReader(os.path.join(ck, "global_step2"))
    assert all(r.full(n).abs().sum() > 0 for n in r.params)
    for n in r.params:
        assert sd[n].dtype == torch.float32 and torch.equal(sd[n], r.full(n)), n
    shutil.rmtree(ck)
