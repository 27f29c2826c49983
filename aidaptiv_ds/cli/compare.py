"""``aidaptiv-ds compare``: aidaptiv_ds next to DeepSpeed's native NVMe offload and its CPU offload.

The same Llama, seed, batches and number of steps run as separate processes through DeepSpeed's
native NVMe offload (its compiled aio op where it loads), DeepSpeed's CPU offload, and aidaptiv_ds
with DRAM budget 0 and "auto"; the table shows median step time after warm-up, bytes written and
read per parameter per step, I/O wait share, peak RSS and launch-to-first-step, each with its ratio
to native, and each backend's overlap efficiency (step / max(compute-only step, I/O time at the
cache path's measured GB/s)). A step is an optimizer step: with ``--gradient-accumulation N`` it is N
micro-batches, and every figure per step covers all N. Examples::

    aidaptiv-ds compare --params 150M --dtype fp32,bf16 --seq 256 --steps 6 --repeats 2 \\
        --cache /tmp/aidaptiv_compare --json compare.json
    TORCH_EXTENSIONS_DIR=/tmp/aid/torch_ext aidaptiv-ds compare --params 20M --libaio-root /tmp/aid/libaio/root
    aidaptiv-ds compare --params 150M --gradient-accumulation 4 --backends cpu,aidaptiv0 --aio python

See :mod:`aidaptiv_ds.bench.compare` for the method and :mod:`aidaptiv_ds.bench.summary` for each figure.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

from ..units import parse_size


def _gradient_accumulation(text: str) -> int:
    """``--gradient-accumulation``'s value: micro-batches per optimizer step, an integer >= 1.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse names the flag; the message the value and the fix).
    """
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an integer >= 1; give the micro-batches per optimizer step, e.g. "
            f"--gradient-accumulation 4 (1, the default, accumulates nothing)")
    return n


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_model_args(p: argparse.ArgumentParser, default_preset: str | None) -> None:
    """``--params`` / ``--hidden`` ... (shared with the large-model run)."""
    from ..bench.models import PRESETS

    g = p.add_argument_group("model (a HF LlamaConfig)")
    g.add_argument("--params", default=None, choices=list(PRESETS),
                   help=f"size preset (default {default_preset} unless --hidden and --layers are given)")
    g.add_argument("--hidden", type=int, help="hidden size (with --layers instead of a preset, or to override it)")
    g.add_argument("--layers", type=int, help="decoder blocks")
    g.add_argument("--intermediate", type=int, help="MLP width (default 8/3 x hidden)")
    g.add_argument("--heads", type=int, help="attention heads (default hidden / 64)")
    g.add_argument("--kv-heads", type=int, help="key/value heads (default = heads)")
    g.add_argument("--vocab", type=int, help="vocabulary size (default 32000)")


def shape_from_args(args, default_preset: str | None):
    from ..bench.models import resolve_shape

    preset = args.params
    if preset is None and not (args.hidden and args.layers):
        preset = default_preset
    return resolve_shape(preset, args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads, args.vocab,
                         seq=args.seq)


def add_settings_args(p: argparse.ArgumentParser) -> None:
    """Settings every backend shares, and the native aio options."""
    g = p.add_argument_group("training settings (identical for every backend)")
    g.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    g.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    g.add_argument("--gradient-accumulation", type=_gradient_accumulation, default=1, metavar="N",
                   help="micro-batches per optimizer step (DeepSpeed's gradient_accumulation_steps; default 1): "
                        "each backend runs N forward/backward/engine.step() per step, and every figure per step "
                        "(step time, bytes per parameter, I/O wait, tokens/s, page faults) is per optimizer step")
    g.add_argument("--sub-group-size", type=float, default=2e7,
                   help="zero_optimization.sub_group_size in elements (default 2e7)")
    g.add_argument("--gradient-clipping", type=float, default=1.0,
                   help="gradient_clipping (default 1.0, HF Trainer's default; 0 turns clipping off, which lets "
                        "aidaptiv_ds step every sub-group inside backward and never keep the gradients)")
    g.add_argument("--aidaptiv-extra", metavar="JSON", default=None,
                   help="a JSON object merged into the \"aidaptiv\" section of the aidaptiv_ds backends "
                        "(ablations), e.g. '{\"step_in_backward\": false}' or "
                        "'{\"io\": {\"reuse_host_memory\": true}}'")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="HF gradient checkpointing of every decoder layer (non-reentrant), in every backend")
    g.add_argument("--persistence-threshold", type=float, default=0,
                   help="stage3_param_persistence_threshold (default 0: every parameter is offloaded)")
    g.add_argument("--max-reuse-distance", type=float, default=0,
                   help="stage3_max_reuse_distance (default 0: a parameter is released after each use; with "
                        "DeepSpeed's 1e9 its native swapper needs a pool buffer per parameter of a small model)")
    g.add_argument("--native-pipeline", action="store_true",
                   help="DeepSpeed native: pipeline_read/pipeline_write of its optimizer swapper (default off, as "
                        "DeepSpeed's default)")
    g.add_argument("--param-buffer-count", type=int, default=5,
                   help="DeepSpeed native: offload_param.buffer_count (default 5, DeepSpeed's default; buffer_size "
                        "is set to the largest parameter)")
    g.add_argument("--native-no-dedup", action="store_true",
                   help="run DeepSpeed native unmodified: without it, its swap_in drops the repeated lm_head its "
                        "NVMe prefetch passes (DeepSpeed 0.19.8 asserts 'already assigned swap buffer' otherwise)")
    g.add_argument("--allocator-as-shipped", action="store_true",
                   help="do not give the DeepSpeed backends the glibc allocator settings (mmap threshold 1 GiB) "
                        "that aidaptiv_ds's runtime applies to its own process; by default every backend runs "
                        "with them so the comparison is of storage paths, not allocators")
    g.add_argument("--aio-intra-op", type=int, default=1,
                   help="DeepSpeed native: aio.intra_op_parallelism (default 1, DeepSpeed's default)")
    g.add_argument("--pin-memory", action="store_true",
                   help="pin_memory in both offload sections (DeepSpeed's CPU offload and native NVMe buffers in "
                        "page-locked memory; what GPU runs use; aidaptiv_ds pins its buffers whenever CUDA is visible)")
    a = p.add_argument_group("DeepSpeed's compiled aio op (native backend)")
    a.add_argument("--aio", choices=("compiled", "python"), default="compiled",
                   help="compiled: DeepSpeed's async_io op from the torch extensions cache (default); python: "
                        "aidaptiv_ds's pure-Python aio handle")
    a.add_argument("--build-aio", action="store_true",
                   help="JIT-build the op once if it is not in the cache (about 10 minutes on 2 cores; needs libaio)")
    a.add_argument("--torch-extensions-dir", default=None,
                   help="TORCH_EXTENSIONS_DIR holding the async_io build (default: the environment's, else torch's)")
    a.add_argument("--libaio-root", default=None,
                   help="an unpacked libaio1 + libaio-dev tree (usr/include, usr/lib/...) when libaio is not installed")


def settings_from_args(args, dtype: str):
    from ..bench.backends import TrainSettings

    for flag, v in (("--seq", args.seq), ("--micro-batch", args.micro_batch), ("--sub-group-size", args.sub_group_size),
                    ("--param-buffer-count", args.param_buffer_count), ("--aio-intra-op", args.aio_intra_op)):
        if v < 1:
            raise ValueError(f"{flag} {v}: must be >= 1")
    clip = float(getattr(args, "gradient_clipping", 1.0))
    if not clip >= 0.0 or clip == float("inf"):
        raise ValueError(f"--gradient-clipping {clip}: must be a finite number >= 0 (0 turns clipping off)")
    extra = _aidaptiv_extra(getattr(args, "aidaptiv_extra", None))
    return TrainSettings(dtype=dtype, micro_batch=args.micro_batch, seq=args.seq, aidaptiv_extra=extra,
                         gradient_accumulation=int(getattr(args, "gradient_accumulation", 1)),
                         sub_group_size=int(args.sub_group_size), persistence_threshold=int(args.persistence_threshold),
                         max_reuse_distance=int(args.max_reuse_distance),
                         native_pipeline=args.native_pipeline, param_buffer_count=args.param_buffer_count,
                         aio_intra_op=args.aio_intra_op, pin_memory=bool(getattr(args, "pin_memory", False)),
                         clip=clip, activation_checkpointing=bool(getattr(args, "activation_checkpointing", False)))


def _aidaptiv_extra(text: str | None) -> dict | None:
    """``--aidaptiv-extra``'s JSON object, or None when not given.

    Raises:
        ValueError: not valid JSON, or not a JSON object (names the flag, the value and the fix).
    """
    if not text:
        return None
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--aidaptiv-extra {text!r}: not valid JSON ({e}); give an object such as "
                         f"'{{\"step_in_backward\": false}}'") from None
    if not isinstance(extra, dict):
        raise ValueError(f"--aidaptiv-extra {text!r}: must be a JSON object of \"aidaptiv\" keys, "
                         f"e.g. '{{\"io\": {{\"reuse_host_memory\": true}}}}'")
    return extra


def _drive_gbps(text: str | None) -> tuple[float, float] | None:
    if not text:
        return None
    try:
        read, write = (float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--drive-gbps {text!r}: give READ,WRITE in GB/s, e.g. 3.1,2.4") from None
    if read <= 0 or write <= 0:
        raise ValueError(f"--drive-gbps {text!r}: both rates must be > 0")
    return read, write


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``compare`` subcommand to an ``argparse`` subparsers object."""
    p = subparsers.add_parser("compare", help="aidaptiv_ds vs DeepSpeed native NVMe and CPU offload, side by side",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(p)
    return p


def configure(p: argparse.ArgumentParser) -> None:
    """Arguments of ``compare`` on any parser (the subcommand and ``launch/compare.py``)."""
    from ..bench.backends import BACKENDS, OPTIONAL_BACKENDS

    add_model_args(p, "150M")
    add_settings_args(p)
    r = p.add_argument_group("runs")
    r.add_argument("--dtype", default="fp32",
                   help="fp32, bf16, or fp32,bf16 for both regimes one after the other (default fp32)")
    r.add_argument("--backends", default=",".join(BACKENDS),
                   help=f"comma-separated, from {','.join(BACKENDS + OPTIONAL_BACKENDS)} (default "
                        f"{','.join(BACKENDS)}; aidaptiv_grads: a DRAM budget of the gradients plus 5%%)")
    r.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default 6)")
    r.add_argument("--warmup", type=int, default=2, help="leading steps of each run not measured (default 2)")
    r.add_argument("--repeats", type=int, default=2, help="runs per backend, interleaved (default 2)")
    r.add_argument("--seed", type=int, default=0, help="model init and batch seed (default 0)")
    r.add_argument("--cache", default="/tmp/aidaptiv_compare",
                   help="work directory: run directories and cache paths (default /tmp/aidaptiv_compare)")
    r.add_argument("--json", default=None, metavar="PATH", help="write the full result (every run, every step) here")
    r.add_argument("--mem-limit", type=_size, default=None,
                   help="kill a run whose RSS exceeds this (default 90%% of RAM)")
    r.add_argument("--timeout", type=float, default=3600, help="kill a run after this many seconds (default 3600)")
    r.add_argument("--deadline-s", type=float, default=None, metavar="SECONDS",
                   help="time budget of the whole command: the run in progress is stopped SECONDS after the start "
                        "and later runs are recorded as skipped (the JSON keeps every run done)")
    r.add_argument("--drive-gbps", default=None, metavar="READ,WRITE",
                   help="read,write GB/s of the cache path's drive measured elsewhere (e.g. aidaptiv-ds bench-io on "
                        "the same path): used for the overlap efficiency instead of the bench-io, which is then "
                        "not run")
    r.add_argument("--profile", action="store_true",
                   help="cProfile the measured steps of every run into <run dir>/profile.prof (inflates times)")
    r.add_argument("--keep-cache", action="store_true", help="keep each run's cache files")
    r.add_argument("--io-bench-size", type=_size, default=1 << 30, metavar="SIZE",
                   help="test file of the short bench-io of the cache path before and after the runs, whose GB/s "
                        "give the overlap efficiency (default 1GiB; 0 skips it; not run with --drive-gbps)")
    r.add_argument("--timeline", default=None, metavar="N-M",
                   help="record optimizer steps N..M of every run into <run dir>/timeline-rank0.json (draw one with "
                        "aidaptiv-ds timeline <run dir>)")
    p.set_defaults(func=run)


def run(args) -> int:
    """Run the comparison(s), print the table(s), write the JSON. Returns the exit code (1 if a run failed).

    Raises:
        ValueError: bad arguments (printed as a usage error by the CLI).
    """
    from ..bench.compare import compare
    from ..bench.runner import stop_children_on_sigterm

    stop_children_on_sigterm()
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if not dtypes or any(d not in ("fp32", "bf16") for d in dtypes):
        raise ValueError(f"--dtype {args.dtype!r}: use fp32, bf16 or fp32,bf16")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    shape = shape_from_args(args, "150M")
    timeline = None
    if args.timeline:
        from ..telemetry.timeline import parse_steps

        timeline = parse_steps(args.timeline, "--timeline")
    command = " ".join(shlex.quote(a) for a in getattr(args, "argv", None) or sys.argv)
    deadline = None if getattr(args, "deadline_s", None) is None else time.time() + float(args.deadline_s)
    drive = _drive_gbps(getattr(args, "drive_gbps", None))
    out: list[dict] = []

    def write_json(partial: dict | None = None) -> None:
        """Rewrite ``--json`` with the comparisons done and ``partial`` (the one in progress, after each
        of its runs): atomically, so a reader or a kill at any moment sees a whole report, never a part."""
        if args.json:
            from ..io.atomic import atomic_write

            report = {"comparisons": out + ([partial] if partial else [])}
            atomic_write(args.json, json.dumps(report, indent=1).encode())

    for dtype in dtypes:
        res = compare(shape, settings_from_args(args, dtype), backends=backends, steps=args.steps, warmup=args.warmup,
                      repeats=args.repeats, work_dir=args.cache, seed=args.seed, aio=args.aio,
                      build_aio=args.build_aio, extensions_dir=args.torch_extensions_dir,
                      libaio_root=args.libaio_root, mem_limit_bytes=args.mem_limit, timeout_s=args.timeout,
                      profile=args.profile, keep_cache=args.keep_cache, native_dedup=not args.native_no_dedup,
                      same_allocator=not args.allocator_as_shipped, io_bench_bytes=args.io_bench_size,
                      timeline=timeline, command=command, deadline=deadline, progress=write_json, drive_gbps=drive,
                      say=lambda m: print(m, file=sys.stderr, flush=True))
        out.append(res)
        write_json()
    m = out[0]["machine"]
    isa = ", ".join(n for n, k in (("AVX2", "avx2"), ("AVX512-BF16", "avx512_bf16"), ("AMX-BF16", "amx_bf16")) if m[k])
    print(f"Machine: {m['cpu']} ({isa or 'no AVX2'}), {m['cores']} cores, {(m['ram_bytes'] or 0) / 2 ** 30:.1f} GiB "
          f"RAM, cache path on "
          f"{m['cache_filesystem']} ({m['cache_device']}); torch {m['torch']}, DeepSpeed {m['deepspeed']}, "
          f"transformers {m['transformers']}")
    code = out[0]["code"]
    print(f"Code: aidaptiv_ds {code['commit']}{' + local changes' if code['dirty'] else ''}")
    print(f"Command: {command}\n")
    for res in out:
        print(res["table"] + "\n")
    return 0 if all(f["ok"] for res in out for f in res["summary"].values()) else 1
