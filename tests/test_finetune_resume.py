"""Save and resume in the main job (launch/finetune.py), with HF's names and layout.

* a 6-step run with ``--save_steps 3`` writes ``checkpoint-3`` and ``checkpoint-6``; a new run resumed
  from ``checkpoint-3`` gives the same losses, learning rates and final eval loss for steps 4-6, bit
  for bit (the model has dropout and the config a warm-up/decay LR schedule, so the RNG states and the
  scheduler must be restored, and grad accumulation 2 makes the skipped data a whole number of windows);
* without its RNG file the resumed run differs (the check above can fail; ``slow``);
* a run killed (SIGKILL) after step 4 and resumed with ``latest`` skips an interrupted newer save,
  continues bit for bit, rewrites ``metrics.jsonl`` so every step appears once, and
  ``--save_total_limit 1`` leaves only the newest complete checkpoint, which ``aidaptiv-ds export``
  turns into an HF directory that reproduces the final eval loss.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys

import pytest

from _finetune_helpers import AIDAPTIV_CFG, finetune, lines, run, step_lines, summary

pytestmark = pytest.mark.subprocess

COMMON = ["--max_steps", "6", "--save_steps", "3", "--dram_budget", "0", "--gradient_accumulation_steps", "2",
          "--per_device_train_batch_size", "4"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The demo's data and model with attention dropout 0.1, and aidaptiv_zero3.json with an LR schedule."""
    root = tmp_path_factory.mktemp("resume_inputs")
    code = (f"from aidaptiv_ds.finetune.demo import prepare_demo; import json; m, d = prepare_demo({str(root)!r}); "
            f"c = json.load(open(m + '/config.json')); c['attention_dropout'] = 0.1; "
            f"json.dump(c, open(m + '/config.json', 'w')); print(m); print(d)")
    p = run([sys.executable, "-c", code])
    model, data = p.stdout.split()[-2:]
    with open(AIDAPTIV_CFG, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                                                            "warmup_num_steps": 2, "total_num_steps": "auto"}}
    cfg_path = root / "ds.json"
    cfg_path.write_text(json.dumps(cfg))
    return ["--model_name_or_path", model, "--data_path", data, "--deepspeed", str(cfg_path),
            "--learning_rate", "1e-3", "--cache_path", str(root / "cache")]


@pytest.fixture(scope="module")
def straight(inputs, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("straight"))
    finetune(*inputs, *COMMON, "--output_dir", out)
    return out


def _losses(out, steps=None):
    return [(s["step"], s["loss"], s["lr"]) for s in step_lines(out) if steps is None or s["step"] in steps]


def test_checkpoints_have_hf_names_and_layout(straight):
    assert sorted(os.listdir(straight)) >= ["checkpoint-3", "checkpoint-6"]
    c3 = os.path.join(straight, "checkpoint-3")
    for name in ("trainer_state.json", "rng_state.pth", "latest", "global_step3"):
        assert os.path.exists(os.path.join(c3, name)), name
    st = json.load(open(os.path.join(c3, "trainer_state.json")))
    assert st["global_step"] == 3 and st["max_steps"] == 6
    assert [h["step"] for h in st["log_history"] if "loss" in h] == [1, 2, 3]
    lrs = [lr for _, _, lr in _losses(straight)]
    assert len(set(lrs)) > 2          # the schedule really moves the learning rate


def test_resume_from_checkpoint_3_continues_bit_for_bit(inputs, straight, tmp_path):
    out = str(tmp_path / "resumed")
    p = finetune(*inputs, *COMMON, "--output_dir", out, "--resume_from_checkpoint",
                 os.path.join(straight, "checkpoint-3"))
    assert "resumed from" in p.stderr
    assert _losses(out) == _losses(straight, {4, 5, 6})
    s, ref = summary(out), summary(straight)
    assert s["final_eval_loss"] == ref["final_eval_loss"] and s["eval_loss_before"] == ref["eval_loss_before"]
    assert s["resumed_from_step"] == 3 and s["steps"] == 6


@pytest.mark.slow
def test_resume_without_the_rng_state_is_not_exact(inputs, straight, tmp_path):
    """The control of the test above: the dropout draws depend on the restored RNG."""
    ck = tmp_path / "checkpoint-3"
    shutil.copytree(os.path.join(straight, "checkpoint-3"), ck)
    os.unlink(ck / "rng_state.pth")
    out = str(tmp_path / "resumed")
    p = finetune(*inputs, *COMMON, "--output_dir", out, "--resume_from_checkpoint", str(ck))
    assert "RNG states are not restored" in p.stderr
    assert [x[1] for x in _losses(out)] != [x[1] for x in _losses(straight, {4, 5, 6})]


def test_killed_after_step_4_resumes_from_latest(inputs, straight, tmp_path):
    out = str(tmp_path / "killed")
    args = [*inputs, *COMMON, "--output_dir", out, "--save_total_limit", "1"]
    p = finetune(*args, check=False, AIDAPTIV_TEST_KILL_AFTER_STEP="4")
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-3000:])
    assert [s["step"] for s in step_lines(out)] == [1, 2, 3, 4]
    os.makedirs(os.path.join(out, "checkpoint-5", "global_step5"))   # what a save killed half-way leaves
    p = finetune(*args, "--resume_from_checkpoint", "latest")
    assert "skipping checkpoint-5 (incomplete" in p.stderr and "resumed from" in p.stderr
    assert _losses(out, {4, 5, 6}) == _losses(straight, {4, 5, 6})
    assert [s["step"] for s in step_lines(out)] == [1, 2, 3, 4, 5, 6]        # step 4 of the killed run is gone
    assert [ln["resumed_from"] for ln in lines(out) if "resumed_from" in ln and not ln.get("summary")] == \
        [os.path.join(out, "checkpoint-3")]
    s = summary(out)
    assert s["final_eval_loss"] == summary(straight)["final_eval_loss"]
    assert s["checkpoints"] == [os.path.join(out, "checkpoint-6")]           # --save_total_limit 1
    # the checkpoint is what aidaptiv-ds export reads; the tokenizer comes from the run's model without --source
    hf = str(tmp_path / "hf")
    model = inputs[inputs.index("--model_name_or_path") + 1]
    p = run([sys.executable, "-m", "aidaptiv_ds.cli.main", "export", os.path.join(out, "checkpoint-6"), "--output", hf])
    assert f"(tokenizer from the run's model {model})" in p.stdout
    assert os.path.isfile(os.path.join(hf, "tokenizer.json")) or os.path.isfile(os.path.join(hf, "tokenizer_config.json"))
    code = (f"import json; from aidaptiv_ds.finetune.evaluate import reload_eval_loss; "
            f"import shutil; shutil.copy({os.path.join(out, 'eval_split.jsonl')!r}, {hf!r}); "
            f"shutil.copy({os.path.join(out, 'finetune_args.json')!r}, {hf!r}); "
            f"print('RESULT', json.dumps(reload_eval_loss({hf!r})))")
    got = json.loads(run([sys.executable, "-c", code]).stdout.split("RESULT", 1)[1])
    assert got["eval_loss"] == pytest.approx(s["final_eval_loss"], rel=1e-6)


def test_resume_errors_name_the_flag(tmp_path):
    p = finetune("--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest", check=False)
    assert p.returncode != 0 and "--resume_from_checkpoint latest: no complete checkpoint-N" in p.stderr
    (tmp_path / "checkpoint-2").mkdir()
    p = finetune("--output_dir", str(tmp_path), "--resume_from_checkpoint", str(tmp_path / "checkpoint-2"), check=False)
    assert p.returncode != 0 and "the checkpoint is incomplete" in p.stderr
