"""Differential fuzzer: random ZeRO-3 configs and model shapes, trained with DeepSpeed's CPU offload (the
oracle) and with aidaptiv_ds, compared bit for bit.

The promise is "add one section to your DeepSpeed JSON and keep your project". So the draws come from
what users run: DeepSpeed's documented ZeRO-3 knobs, each left out (DeepSpeed's default) about as often
as set, HF's and DeepSpeed's clipping defaults (``gradient_clipping`` left out is 1.0 in DeepSpeed 0.19.8),
gradient accumulation, a learning-rate scheduler, fp32 and bf16, one and two ranks, the DRAM budgets, offload
combinations, and the
model shapes of :mod:`aidaptiv_ds.bench.fuzz_models`. Each case trains a few optimizer steps with both
backends (:mod:`aidaptiv_ds.bench.fuzz_worker`, a fresh process set each) and compares per-micro-step
losses, per-step gradient norms, every gathered parameter, and each rank's fp32 master weights and Adam
moments: equal bits, or the case fails.

Command line::

    python -m aidaptiv_ds.bench.fuzz --draws 20 --seed 1          # 20 random cases
    python -m aidaptiv_ds.bench.fuzz --case '{"model": "mlp", ...}'  # one case (a printed reproducer)
    python -m aidaptiv_ds.bench.fuzz --draws 20 --shrink           # a failing case is reduced first

A failing case is printed as the smallest case found that still fails (``--shrink``: knobs unset, fewer
steps, one rank, ...; each reduction is a full pair of runs) and the command that reruns it. Every
divergence this found is a named regression test in ``tests/test_drop_in.py``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from .fuzz_models import KINDS, LM_KINDS

#: the kinds that are HF models, whose trunk a layer-major step finds (``integration/layer_major.py``)
HF_KINDS = LM_KINDS[1:]

#: ``zero_optimization`` knobs drawn, with the values a set knob takes (a knob is left out with
#: probability :data:`UNSET_P`, so DeepSpeed's default runs as often as a chosen value).
ZERO_KNOBS: dict[str, list] = {
    "sub_group_size": [1000, 20000, 100000, 1000000, 1000000000],
    "stage3_param_persistence_threshold": [0, 100, 10000, 100000],
    "reduce_bucket_size": [5000, 200000, 500000000],
    "stage3_prefetch_bucket_size": [0, 5000, 500000, 50000000],
    "stage3_max_live_parameters": [1000, 100000, 1000000000],
    "stage3_max_reuse_distance": [0, 1000, 1000000000],
    "contiguous_gradients": [True, False],
    "overlap_comm": [True, False],
}
UNSET_P = 0.5
MODEL_SIZES = {  # (hidden, layers) per kind: small enough for CI, several sub-groups at the small sizes
    "mlp": [(64, 3), (256, 4), (1024, 8)], "mlp_bias": [(64, 3), (256, 4)], "mlp_twice": [(64, 3), (128, 3)],
    "mlp_unused": [(64, 3), (128, 2)], "mlp_frozen": [(64, 3), (128, 3)], "mlp_ckpt": [(64, 3), (128, 2)],
    "tied_lm": [(64, 2), (128, 2)], "llama": [(64, 2), (128, 2)], "gpt2": [(64, 2)], "qwen2": [(64, 2)],
    "llama_ckpt": [(64, 2)], "gpt2_ckpt": [(64, 2)], "qwen2_ckpt": [(64, 2)],
}


def draw(rng: random.Random, world: list[int] | None = None, layer_major: bool = False) -> dict:
    """One random case (a JSON-able dict; see :mod:`aidaptiv_ds.bench.fuzz_worker` for how it is run).

    ``layer_major``: draw only HF models and train ours with ``engine.train_batch`` (layer-major, the oracle
    micro-batch by micro-batch); the draws of a seed differ from those without it."""
    kind = rng.choice([k for k in KINDS if k in HF_KINDS] if layer_major else KINDS)
    hidden, layers = rng.choice(MODEL_SIZES[kind])
    case: dict = {"model": kind, "hidden": hidden, "layers": layers,
                  "dtype": rng.choice(["fp32", "bf16"]), "world": rng.choice(world or [1, 2]),
                  "ga": rng.choice([1, 1, 2, 4]), "micro": rng.choice([1, 2]), "steps": 3,
                  "zinit": rng.random() < 0.5,
                  "offload": rng.choice(["nvme", "nvme", "nvme", "param_cpu", "param_none"]),
                  "budget": rng.choice(["0", "0", "auto", "half"]), "seed": rng.randrange(1000),
                  "optimizer": rng.choice(["AdamW", "AdamW", "Adam"])}
    if rng.random() < 0.3:
        case["scheduler"] = "WarmupLR"
    clip = rng.choice(["unset", "unset", 0.0, 1.0, 1e-3])
    if clip != "unset":
        case["clip"] = clip
    case["zero"] = {k: rng.choice(v) for k, v in ZERO_KNOBS.items() if rng.random() >= UNSET_P}
    if case["offload"] == "nvme" and rng.random() >= UNSET_P:
        case["max_in_cpu"] = rng.choice([0, 10000, 1000000000])
    # the updates riding the next forward are off by default on CPU ranks ("auto"): half the cases turn them on
    # (a generator of its own, so the draws of a seed stay the ones they were)
    if random.Random(case["seed"] * 7919 + 1).random() < 0.5:
        case["aidaptiv"] = {"step_rides_forward": True}
    if hidden * hidden * layers > 4_000_000:  # a large MLP: keep it short
        case["steps"], case["ga"] = 3, 1
    if layer_major:
        case["layer_major"] = True
    return case


@dataclasses.dataclass
class Outcome:
    """The result of one case: ``diffs`` empty when both backends agree bit for bit; ``error`` when a run
    failed (its output tail); ``oracle_failed`` when DeepSpeed's own offload cannot run the case (not a valid
    DeepSpeed setup: nothing to compare with, not counted as a failure); seconds per backend."""
    case: dict
    diffs: list[str]
    error: str | None = None
    seconds: dict = dataclasses.field(default_factory=dict)
    oracle_failed: bool = False

    @property
    def ok(self) -> bool:
        return not self.diffs and self.error is None

    @property
    def status(self) -> str:
        return "oracle-fails" if self.oracle_failed else "ok" if self.ok else "ERROR" if self.error else "DIFFERS"


def _env(world: int, base: dict | None = None) -> dict:
    from .runner import REPO, numerics_env

    env = dict(base if base is not None else os.environ)
    env.update(numerics_env(env))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("AIDAPTIV_DS_NO_AUTOINSTALL", None)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # the venv's ninja
    if world > 1:
        env["OMP_NUM_THREADS"] = "1"  # two ranks on a small machine: one compute thread each
    return env


def run_backend(case: dict, backend: str, workdir: str, timeout: int = 900, env: dict | None = None
                ) -> tuple[list[dict] | None, str, float]:
    """Train ``case`` with ``backend`` in ``workdir``; returns ``(per-rank results or None on failure,
    output tail, seconds)``."""
    from ..integration.shm_buffer import release_allreduce_buffers_of_port
    from ..ports import free_port

    world = int(case.get("world", 1))
    out = os.path.join(workdir, backend)
    shutil.rmtree(out, ignore_errors=True)
    args = ["--case", json.dumps(case), "--backend", backend, "--cache", os.path.join(workdir, f"cache-{backend}"),
            "--out", out]
    e = _env(world, env)
    port = str(free_port())
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", port,
               "-m", "aidaptiv_ds.bench.fuzz_worker", *args]
    else:
        e["MASTER_PORT"] = port
        cmd = [sys.executable, "-m", "aidaptiv_ds.bench.fuzz_worker", *args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as ex:
        text, rc = f"timed out after {timeout} s\n{ex.stdout or ''}{ex.stderr or ''}", -1
    secs = time.monotonic() - t0
    shutil.rmtree(os.path.join(workdir, f"cache-{backend}"), ignore_errors=True)
    release_allreduce_buffers_of_port(port)  # the ranks have exited: what DeepSpeed's shm all-reduce left
    if rc != 0:
        return None, _tail(text), secs
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    return ranks, _tail(text), secs


_FATAL = ("terminate called", "what():", "Segmentation fault", "Aborted", "corrupted", "double free")
"""What a process prints when it dies by a signal of its own (C++'s ``std::terminate``, glibc's heap checks):
such lines carry no "Error" and would sit above the launcher's traceback, out of the tail."""


def _tail(text: str, lines: int = 25) -> str:
    """The end of a run's output, led by its first error line of each rank (a launcher's own traceback
    follows a rank's failure and would hide it)."""
    keep = [ln for ln in text.splitlines() if "Warning" not in ln and ln.strip()]
    errors = [ln for ln in keep if ("Error" in ln or "error:" in ln or any(m in ln for m in _FATAL))
              and "ChildFailedError" not in ln and "elastic" not in ln]
    head = list(dict.fromkeys(errors))[:6]
    return "\n".join(head + (["..."] if head else []) + keep[-lines:])


def _same(a, b) -> bool:
    """Equal bits: tensors of one shape whose fp32 values have the same bit patterns (so -0.0 differs from 0.0
    and a NaN equals itself), or equal plain values."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.shape != b.shape:
            return False
        return torch.equal(a.float().contiguous().view(torch.int32), b.float().contiguous().view(torch.int32))
    return a == b


def compare(ref: list[dict], got: list[dict]) -> list[str]:
    """What differs between the oracle's per-rank results ``ref`` and ours ``got``, bit for bit
    (``[]`` when nothing): losses, gradient norms, gathered parameters, each rank's masters and moments."""
    out = []
    if ref[0]["losses"] != got[0]["losses"]:
        out.append(f"losses differ: oracle {ref[0]['losses']} ours {got[0]['losses']}")
    if ref[0]["norms"] != got[0]["norms"]:
        out.append(f"gradient norms differ: oracle {ref[0]['norms']} ours {got[0]['norms']}")
    for name in sorted(set(ref[0]["params"]) | set(got[0]["params"])):
        a, b = ref[0]["params"].get(name), got[0]["params"].get(name)
        if a is None or b is None:
            out.append(f"parameter {name} missing in {'the oracle' if a is None else 'ours'}")
        elif not _same(a, b):
            out.append(f"parameter {name} differs" + (f" (max abs diff {(a - b).abs().max().item():.3e})"
                                                      if a.shape == b.shape else f" (shape {a.shape} vs {b.shape})"))
    for r, (x, y) in enumerate(zip(ref, got, strict=True)):
        for key in ("masters", "exp_avg", "exp_avg_sq"):
            if not _same(x[key], y[key]):
                out.append(f"rank {r}: {key} differ ({x[key].numel()} vs {y[key].numel()} elements)")
    return out


def run_case(case: dict, workdir: str | None = None, timeout: int = 900, env: dict | None = None) -> Outcome:
    """Train ``case`` with the oracle and with aidaptiv_ds and compare (see the module docstring)."""
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="aidaptiv-fuzz-")
    os.makedirs(workdir, exist_ok=True)
    try:
        ref, ref_log, t_ref = run_backend(case, "cpu", workdir, timeout, env)
        if ref is None:  # the oracle itself fails on this case: nothing to compare with
            return Outcome(case, [], error=f"the oracle (DeepSpeed's CPU offload) failed:\n{ref_log}",
                           seconds={"cpu": t_ref}, oracle_failed=True)
        got, log, t = run_backend(case, "aidaptiv", workdir, timeout, env)
        if got is None:
            return Outcome(case, [], error=f"aidaptiv_ds failed where the oracle ran:\n{log}",
                           seconds={"cpu": t_ref, "aidaptiv": t})
        return Outcome(case, compare(ref, got), seconds={"cpu": t_ref, "aidaptiv": t})
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def _reductions(case: dict):
    """Simpler variants of ``case``, most drastic first (for :func:`shrink`)."""
    for k in list(case.get("zero", {})):
        c = copy.deepcopy(case)
        del c["zero"][k]
        yield c
    simpler = {"world": 1, "ga": 1, "micro": 1, "steps": 2, "zinit": False, "offload": "nvme", "budget": "0",
               "optimizer": "AdamW", "dtype": "fp32"}
    for k, v in simpler.items():
        if case.get(k, v) != v:
            yield {**copy.deepcopy(case), k: v}
    for k in ("clip", "max_in_cpu", "scheduler"):
        if k in case:
            c = copy.deepcopy(case)
            del c[k]
            yield c


def shrink(outcome: Outcome, log=print, budget_s: float = 3600) -> Outcome:
    """Greedily reduce a failing case while it still fails (each try is a full pair of runs)."""
    best, t0 = outcome, time.monotonic()
    progress = True
    while progress and time.monotonic() - t0 < budget_s:
        progress = False
        for c in _reductions(best.case):
            o = run_case(c)
            if not o.ok and not o.oracle_failed:
                log(f"  still fails: {json.dumps(c)}")
                best, progress = o, True
                break
    return best


def reproducer(case: dict) -> str:
    """The shell command that reruns ``case``."""
    return f"python -m aidaptiv_ds.bench.fuzz --case '{json.dumps(case, sort_keys=True)}'"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aidaptiv_ds.bench.fuzz", description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=10, help="random cases to run")
    ap.add_argument("--seed", type=int, default=0, help="seed of the draws (the same seed draws the same cases)")
    ap.add_argument("--world", default="1,2", help="world sizes to draw from (comma-separated)")
    ap.add_argument("--case", default=None, help="run this one case (JSON) instead of drawing")
    ap.add_argument("--layer-major", action="store_true",
                    help="draw HF models only and train ours layer-major (engine.train_batch); the oracle is unchanged")
    ap.add_argument("--shrink", action="store_true", help="reduce a failing case to a smaller one that still fails")
    ap.add_argument("--json", default=None, help="write every outcome to this file")
    a = ap.parse_args(argv)
    if a.case:
        cases = [json.loads(a.case)]
    else:
        rng = random.Random(a.seed)
        cases = [draw(rng, [int(w) for w in a.world.split(",")], a.layer_major) for _ in range(a.draws)]
    outcomes, failed, invalid = [], 0, 0
    for i, case in enumerate(cases):
        o = run_case(case)
        print(f"[{i + 1}/{len(cases)}] {o.status} ({', '.join(f'{k} {v:.0f} s' for k, v in o.seconds.items())}) "
              f"{json.dumps(case, sort_keys=True)}", flush=True)
        if o.oracle_failed:
            invalid += 1
            print("    " + (o.error or "").split("\n...")[0].replace("\n", "\n    "))
        elif not o.ok:
            failed += 1
            if a.shrink:
                o = shrink(o)
            print("\n".join("    " + d for d in o.diffs) or "    " + (o.error or "").replace("\n", "\n    "))
            print(f"    reproduce: {reproducer(o.case)}", flush=True)
        outcomes.append(o)
    print(f"{len(cases)} cases: {len(cases) - failed - invalid} identical, {failed} failing, {invalid} not run by "
          f"DeepSpeed's own offload either")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([dataclasses.asdict(o) for o in outcomes], f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
