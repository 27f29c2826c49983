"""``aidaptiv-ds plan``: will the model fit, where does each byte live, what does a step cost the drives.

Examples::

    aidaptiv-ds plan --model llama-3.1-405b --gpus 2 --vram 96GB --dram 512GB --cache 8TB
    aidaptiv-ds plan --params 70e9 --gpus 4 --vram 48GB --dram 512GB --cache /mnt/c0:2TB --cache /mnt/c1:2TB --json
    aidaptiv-ds plan --model ./my-model --gpus 1 --vram 24GB --dram 128GB --cache /mnt/c0:2TB:read=7:write=6:dwpd=30
    aidaptiv-ds plan --params 7e9 --cache /tmp --cpu-ranks            # training on this machine's CPU, one rank

``--cache`` takes ``[PATH:]SIZE[:read=GBPS][:write=GBPS][:dwpd=N][:years=N]`` or a bare existing
``PATH`` (capacity = its filesystem size). Formulas: :mod:`aidaptiv_ds.planner.plan`.
"""
from __future__ import annotations

import argparse
import json
import os

from ..planner.auto import CPU_REDUCE_BUCKET_NUMEL
from ..planner.model_size import load_model_shape, nearest_preset
from ..planner.plan import (
    DEFAULT_READ_GBPS,
    DEEPSPEED_MAX_LIVE_PARAMETERS,
    DEFAULT_SUB_GROUP_SIZE,
    DEFAULT_WRITE_GBPS,
    MOMENT_BYTES,
    PARAM_BYTES,
    CacheDrive,
    CapacityPlan,
    PlanInput,
    make_plan,
)
from ..store.ledger import EnduranceRating, filesystem_capacity
from ..store.slab import free_bytes
from ..telemetry.nvml import nvml_status
from ..telemetry.sysinfo import host_memory
from ..units import format_bytes, parse_size


def _dec(n: float) -> str:
    """Bytes in decimal units, as drive vendors and ``--vram 96GB`` state them."""
    return format_bytes(n, decimal=True)


_DRIVE_KEYS = {"read": "read_gbps", "write": "write_gbps", "dwpd": "rated_dwpd", "years": "warranty_years"}


def parse_cache_spec(spec: str, defaults: dict) -> CacheDrive:
    """A :class:`CacheDrive` from ``[PATH:]SIZE[:key=value...]`` or an existing ``PATH``.

    A bare ``PATH`` takes the capacity of its filesystem (for DWPD) and its free space now (for the fit).

    ``defaults`` holds ``read_gbps``, ``write_gbps``, ``rated_dwpd``, ``warranty_years``.

    Raises:
        ValueError: naming ``--cache``, the spec and the accepted forms.
    """
    parts = spec.split(":")
    kv = [p for p in parts if "=" in p]
    rest = [p for p in parts if "=" not in p]
    fields = dict(defaults)
    for item in kv:
        k, _, v = item.partition("=")
        if k not in _DRIVE_KEYS:
            raise ValueError(f"--cache {spec!r}: unknown key {k!r}; use {', '.join(_DRIVE_KEYS)} "
                             f"(e.g. /mnt/c0:2TB:read=7:write=6:dwpd=30)")
        try:
            fields[_DRIVE_KEYS[k]] = float(v)
        except ValueError:
            raise ValueError(f"--cache {spec!r}: {k}={v!r} is not a number") from None
    path, size = None, None
    if len(rest) == 1:
        try:
            size = parse_size(rest[0], "--cache")
        except ValueError:
            path = rest[0]
    elif len(rest) == 2:
        path, size = rest[0], parse_size(rest[1], f"--cache {spec!r}")
    else:
        raise ValueError(f"--cache {spec!r}: expected [PATH:]SIZE[:read=GBPS:write=GBPS:dwpd=N:years=N] or an "
                         f"existing PATH, e.g. 8TB or /mnt/cache0:8TB")
    free = None
    if size is None:
        if not os.path.isdir(path):
            raise ValueError(f"--cache {spec!r}: {path!r} is not a size and not an existing directory; give "
                             f"PATH:SIZE (e.g. {path}:2TB) or a size such as 2TB")
        size, free = filesystem_capacity(path), free_bytes(path)
    return CacheDrive(capacity=size, path=path, free=free, **fields)


def register(subparsers) -> None:
    """Add ``plan`` to the ``aidaptiv-ds`` subcommands."""
    p = subparsers.add_parser("plan", help="capacity plan: fit, bytes per tier, step time, endurance",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--params", help="parameter count, e.g. 405e9 (layer shapes from the nearest preset)")
    m.add_argument("--model", help="HF config.json, model directory, or preset (e.g. llama-3.1-405b)")
    p.add_argument("--gpus", type=int, help="GPUs per node (default: NVML count on this host)")
    p.add_argument("--nodes", type=int, default=1, help="nodes; data-parallel size = gpus x nodes (default 1)")
    p.add_argument("--vram", help="memory per GPU, e.g. 96GB (default: NVML, GPU 0)")
    p.add_argument("--dram", help="host memory per node, e.g. 512GB (default: this host's MemTotal)")
    p.add_argument("--dram-budget", default="auto", help="DRAM tier budget per node or 'auto' (default)")
    p.add_argument("--cache", action="append", default=[], metavar="[PATH:]SIZE[:k=v]",
                   help="a cache drive (repeat per drive): 8TB, /mnt/c0:2TB, /mnt/c0:2TB:read=7:write=6:dwpd=30")
    p.add_argument("--read-gbps", type=float, help=f"default drive read GB/s (default {DEFAULT_READ_GBPS})")
    p.add_argument("--write-gbps", type=float, help=f"default drive write GB/s (default {DEFAULT_WRITE_GBPS})")
    p.add_argument("--dwpd", type=float, help=f"default rated DWPD (default {EnduranceRating.rated_dwpd})")
    p.add_argument("--warranty-years", type=float, help=f"default warranty (default {EnduranceRating.warranty_years})")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-step (default 1)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (default 1)")
    p.add_argument("--dtype", default="bf16", choices=sorted(PARAM_BYTES))
    p.add_argument("--optimizer", default="adamw", choices=sorted(MOMENT_BYTES))
    p.add_argument("--no-activation-checkpointing", action="store_true", help="keep all activations")
    p.add_argument("--no-flash-attention", action="store_true", help="attention scores are materialised (s^2)")
    p.add_argument("--dropout", action="store_true", help="the model uses dropout (masks are stored)")
    p.add_argument("--logits-tokens", type=int, default=None, metavar="N",
                   help="tokens per micro-batch the LM head computes logits for (default micro-batch x seq-len; "
                        "fewer when the loss is taken at response tokens only, as launch/finetune.py does)")
    p.add_argument("--sub-group-size", type=float, default=DEFAULT_SUB_GROUP_SIZE,
                   help="optimizer sub-group in elements (DeepSpeed sub_group_size, default 1e9)")
    p.add_argument("--gpu-tflops", type=float, help="peak dense TFLOP/s per GPU for the compute bound")
    p.add_argument("--dataset-tokens", type=float, help="tokens in one epoch (for writes per epoch and run)")
    p.add_argument("--epochs", type=float, default=1.0, help="epochs of the run (default 1)")
    p.add_argument("--step-time", type=float, help="measured seconds per step (endurance pace; default: lower bound)")
    p.add_argument("--cpu-ranks", nargs="?", type=int, const=0, default=None, metavar="N",
                   help="the ranks train on the CPU (DeepSpeed's CPU accelerator), N per node (default: --gpus if "
                        "given, else 1); no GPU flags needed: activations and gathered slices are host memory, and "
                        "there is no VRAM check")
    p.add_argument("--max-live-parameters", type=float, default=DEEPSPEED_MAX_LIVE_PARAMETERS,
                   help="DeepSpeed's stage3_max_live_parameters in elements (default 1e9, DeepSpeed's): host memory "
                        "on CPU ranks")
    p.add_argument("--reduce-bucket-size", type=float, default=None,
                   help="DeepSpeed's reduce_bucket_size in elements, if your config sets it (host memory on CPU "
                        "ranks: three buckets while one is reduced over several ranks, one on a single rank; left "
                        "out, a CPU rank runs with 2e7)")
    p.add_argument("--gradient-clipping", type=float, default=0.0,
                   help="DeepSpeed's gradient_clipping (default 0: off; HF Trainer's default is 1.0): with it on, "
                        "steps inside backward keep their gradients until the norm is known")
    p.add_argument("--step-in-backward", choices=("auto", "true", "false"), default="auto",
                   help="aidaptiv.step_in_backward (default auto: inside backward where the drives hold a second "
                        "copy of the optimizer state)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def plan_input_from_args(args) -> PlanInput:
    """The :class:`PlanInput` for parsed ``plan`` arguments; inputs taken from this host are listed in ``assumed``.

    Raises:
        ValueError: naming the flag, the value and the fix.
    """
    assumed = []
    if args.model:
        shape, n_params, source = load_model_shape(args.model), None, "exact"
    else:
        try:
            n_params = int(float(args.params))
        except ValueError:
            raise ValueError(f"--params: {args.params!r} is not a number; give e.g. 405e9") from None
        shape = nearest_preset(n_params)
        source = f"layer shapes of preset {shape.name} (nearest to --params)"
    cpu_ranks = args.cpu_ranks is not None
    gpus, vram = args.gpus, parse_size(args.vram, "--vram") if args.vram else None
    if cpu_ranks:
        if args.cpu_ranks < 0:
            raise ValueError(f"--cpu-ranks {args.cpu_ranks}: give the number of CPU ranks per node, 1 or more")
        if args.cpu_ranks and gpus is not None and gpus != args.cpu_ranks:
            raise ValueError(f"--cpu-ranks {args.cpu_ranks} and --gpus {gpus} disagree on the ranks per node; "
                             f"give one of them")
        if args.cpu_ranks == 0 and gpus is None:
            assumed.append("1 CPU rank per node (--cpu-ranks without a count)")
        gpus = args.cpu_ranks or gpus or 1
        vram = 0
    elif gpus is None or vram is None:
        st = nvml_status()
        if not st["gpus"]:
            raise ValueError(f"--gpus/--vram: not given and no GPU found on this host ({st['status']}); "
                             f"fix: give --gpus N --vram SIZE (e.g. --gpus 2 --vram 96GB) for a GPU machine, or "
                             f"--cpu-ranks [N] to plan training on this host's CPU")
        if gpus is None:
            gpus = len(st["gpus"])
            assumed.append("gpus (NVML on this host)")
        if vram is None:
            vram = st["gpus"][0]["total_bytes"]
            assumed.append("vram (NVML on this host)")
    if args.dram:
        dram = parse_size(args.dram, "--dram")
    else:
        mem = host_memory()
        if not mem["total_bytes"]:
            raise ValueError("--dram: not given and /proc/meminfo is not readable; fix: give --dram SIZE")
        dram = mem["total_bytes"]
        assumed.append("dram (MemTotal of this host)")
    if not args.cache:
        raise ValueError("--cache: no cache drive given; fix: add --cache SIZE or --cache PATH:SIZE per drive")
    defaults = {"read_gbps": args.read_gbps or DEFAULT_READ_GBPS, "write_gbps": args.write_gbps or DEFAULT_WRITE_GBPS,
                "rated_dwpd": args.dwpd or EnduranceRating.rated_dwpd,
                "warranty_years": args.warranty_years or EnduranceRating.warranty_years}
    drives = [parse_cache_spec(s, defaults) for s in args.cache]
    specs = ":".join(args.cache)
    if args.read_gbps is None and "read=" not in specs:
        assumed.append(f"drive read GB/s ({DEFAULT_READ_GBPS}, a PCIe 4.0 NVMe figure; measure with bench-io)")
    if args.write_gbps is None and "write=" not in specs:
        assumed.append(f"drive write GB/s ({DEFAULT_WRITE_GBPS}; measure with bench-io)")
    if args.dwpd is None and "dwpd=" not in specs:
        assumed.append(f"rated DWPD ({EnduranceRating.rated_dwpd}; give the data sheet's figure)")
    budget = None if str(args.dram_budget).lower() == "auto" else parse_size(args.dram_budget, "--dram-budget")
    return PlanInput(
        shape=shape, n_params=n_params, shape_source=source, gpus=gpus, nodes=args.nodes, vram=vram, dram=dram,
        drives=drives, dram_budget=budget, micro_batch=args.micro_batch, seq_len=args.seq_len,
        grad_accum=args.grad_accum, dtype=args.dtype, optimizer=args.optimizer,
        activation_checkpointing=not args.no_activation_checkpointing, flash_attention=not args.no_flash_attention,
        dropout=args.dropout, sub_group_size=int(args.sub_group_size),
        gpu_flops=args.gpu_tflops * 1e12 if args.gpu_tflops else None,
        dataset_tokens=int(args.dataset_tokens) if args.dataset_tokens else None, epochs=args.epochs,
        step_time_s=args.step_time, cpu_ranks=cpu_ranks,
        max_live_parameters=int(args.max_live_parameters),
        reduce_bucket_size=int(args.reduce_bucket_size) if args.reduce_bucket_size else CPU_REDUCE_BUCKET_NUMEL, gradient_clipping=args.gradient_clipping,
        step_in_backward={"auto": "auto", "true": True, "false": False}[args.step_in_backward],
        logits_tokens=args.logits_tokens, assumed=assumed)


def _days(x: float | None) -> str:
    if x is None or x == float("inf"):
        return "never (no writes)"
    return f"{x:,.1f} days" if x < 3650 else f"{x / 365:,.1f} years"


def _secs(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:,.2f} s" if x < 600 else f"{x / 60:,.1f} min"


def format_plan(p: CapacityPlan) -> str:
    """The plan as text for people (the JSON carries the same numbers)."""
    m, i = p.model, p.inputs
    cpu = bool(i.get("cpu_ranks"))
    out = [f"model      {m['name']} ({m['model_type']}): {p.n_params:,} parameters"
           + ("" if m["shape_source"] == "exact" else f"; {m['shape_source']}"),
           f"run        {i['gpus']} {'CPU rank' if cpu else 'GPU'}(s) x {i['nodes']} node(s) (dp={p.dp}), "
           f"micro-batch {i['micro_batch']}, "
           f"seq {i['seq_len']}, grad-accum {i['grad_accum']}, {i['dtype']}, {i['optimizer']}, "
           f"checkpointing {'on' if i['activation_checkpointing'] else 'off'}",
           f"state      {_dec(p.total_state_bytes)} = {p.bytes_per_param:.2f} B/param "
           f"({p.state_bytes_per_param} B/param of training state + activations); "
           f"rule of thumb 20 B/param = {_dec(p.rule_of_thumb_bytes)}",
           ""]
    if cpu:
        out.append(f"{'where (whole job)':<18}{'DRAM':>12}{'cache':>12}")
        for k, t in p.tiers.items():
            out.append(f"{k:<18}{_dec(t['dram']):>12}{_dec(t['cache']):>12}")
    else:
        out.append(f"{'where (whole job)':<18}{'VRAM':>12}{'DRAM':>12}{'cache':>12}")
        for k, t in p.tiers.items():
            out.append(f"{k:<18}{_dec(t['vram']):>12}{_dec(t['dram']):>12}{_dec(t['cache']):>12}")
    v, d, r = p.vram_per_gpu, p.dram, p.residency
    out.append("")
    if not cpu:
        out.append(f"VRAM/GPU   {_dec(v['total'])} of {_dec(i['vram'])}: gathered slices "
                   f"{_dec(v['gathered_params'])}, "
                   f"slice grads {_dec(v['slice_gradients'])}, activations {_dec(v['activations'])}, "
                   f"bucket+overhead {_dec(v['reduce_bucket'] + v['overhead'])}")
    host = f"DRAM/node  {_dec(d['host_bytes'])}: margin {_dec(d['margin_bytes'])}, working set " \
           f"{_dec(d['working_set_bytes'])}"
    if cpu:
        c = p.cpu_rank_host
        host += (f" (per CPU rank: baseline {_dec(c['baseline'])} + the larger of backward {_dec(c['backward'])} "
                 f"[DeepSpeed's gathered parameters and reduce buckets {_dec(c['deepspeed'])}, activations "
                 f"{_dec(c['activations'])}, read-ahead {_dec(c['readahead'])}, gradient window] and optimizer "
                 f"pipeline {_dec(c['optimizer'])})")
    host += f", budget {_dec(d['budget_bytes'])} ({_dec(d['per_rank_bytes'])}/rank)"
    if p.rank_host:
        h = p.rank_host
        host += (f"; per rank besides the budget, the process's peak {_dec(h['peak'])} (model build under zero.Init "
                 f"{_dec(h['construction'])}, deepspeed.initialize {_dec(h['initialization'])}, steps "
                 f"{_dec(h['steps'])})")
    sib = (f"inside backward (a second copy of the state on the drives, {_dec(r['shadow_bytes'])}"
           + ("; gradients consumed at once, never written)" if not i.get("gradient_clipping")
              else "; gradients kept until the clipping norm is known)")) if r.get("step_in_backward") \
        else "after backward"
    out += [host, f"optimizer  steps {sib}",
            f"resident   gradients {'yes' if r['grads_resident'] else 'no'}, parameters "
            f"{'yes' if r['params_resident'] else 'no'}, {len(r['resident_subgroups'])} optimizer sub-group(s); "
            f"prefetch depth {p.prefetch['depth']}",
            f"per step   written {_dec(p.per_step['write_bytes'])}, read {_dec(p.per_step['read_bytes'])} "
            f"per node ({p.per_step['write_bytes_per_param']:.2f} B/param written"
            + (f"; {_dec(p.per_step['write_bytes_if_clipped'])} on a step the clipping norm redoes"
               if p.per_step['write_bytes_if_clipped'] != p.per_step['write_bytes'] else "")
            + f"); {p.per_step['tokens']:,} tokens",
            f"step time  >= {_secs(p.step_time['lower_bound_s'])} (bound by {p.step_time['bound_by']}; compute "
            f"{_secs(p.step_time['compute_s'])}, reads {_secs(p.step_time['io_read_s'])}, writes "
            f"{_secs(p.step_time['io_write_s'])})"]
    if p.epoch["steps_per_epoch"]:
        out.append(f"epoch      {p.epoch['steps_per_epoch']:,} steps, {_dec(p.epoch['write_bytes_per_epoch'])} "
                   f"written per node; run of {p.epoch['epochs']} epoch(s) ~ {_days(p.epoch['run_days'])}")
    out.append("")
    for n, dr in enumerate(p.drives):
        e = dr.endurance
        line = (f"drive {n}    {dr.path or '(size only)'} {_dec(dr.capacity)}: holds {_dec(dr.state_bytes)}, "
                f"per step R {_dec(dr.read_bytes_per_step)} W {_dec(dr.write_bytes_per_step)}; "
                f"{e['dwpd']:.2f} DWPD at {p.step_time['pace_source']} pace vs {e['rated_dwpd']:g} rated; "
                f"rated TBW {_dec(e['rated_tbw_bytes'])} reached in {_days(e['days_to_rated_tbw'])}")
        if dr.run_tbw_fraction is not None:
            line += f"; the run uses {dr.run_tbw_fraction:.2%} of it"
        out.append(line)
    out.append("")
    if p.fits:
        out.append("verdict    FITS")
    else:
        out.append("verdict    DOES NOT FIT")
        for prob, ch in zip(p.verdict.problems, p.verdict.changes):
            out.append(f"  - {prob}")
            out.append(f"    smallest change: {ch or 'none found among the single changes tried'}")
        after = p.verdict.fits_after_changes
        if after is not None:
            out.append("  re-planned with " + ("that change" if len(p.verdict.changes) == 1 else "these changes")
                       + (": FITS" if after else ": still does not fit"))
    if i["assumed"]:
        out.append("assumed    " + "; ".join(i["assumed"]))
    return "\n".join(out)


def run(args) -> int:
    """Print the plan (text or ``--json``); exit code 0 when it fits, 1 when it does not."""
    p = make_plan(plan_input_from_args(args))
    print(json.dumps(p.as_dict(), indent=1) if args.json else format_plan(p))
    return 0 if p.fits else 1
