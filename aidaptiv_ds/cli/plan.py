"""``aidaptiv-ds plan``: will the model fit, where does each byte live, what does a step cost the drives.

Examples::

    aidaptiv-ds plan --model llama-3.1-405b --gpus 2 --vram 96GB --dram 512GB --cache 8TB
    aidaptiv-ds plan --params 70e9 --gpus 4 --vram 48GB --dram 512GB --cache /mnt/c0:2TB --cache /mnt/c1:2TB --json
    aidaptiv-ds plan --model ./my-model --gpus 1 --vram 24GB --dram 128GB --cache /mnt/c0:2TB:read=7:write=6:dwpd=30
    aidaptiv-ds plan --params 7e9 --cache /tmp --cpu-ranks            # training on this machine's CPU, one rank
    aidaptiv-ds plan --model llama-3.1-405b --gpus 2 --vram 96GB --dram 512GB --cache 8TB:read=7:write=6 --ga 16

``--ga N`` (``--grad-accum``) plans ``N`` micro-batches per optimizer step; ``--schedule`` shows the drive,
link and compute cost of one step micro-batch-major (what the runtime does), layer-major (GreedySnake's
vertical schedule), or both side by side (default), with a step-time estimate from ``--read-gbps`` /
``--write-gbps`` (or each drive's ``read=`` / ``write=``), ``--pcie-gbps`` and ``--gpu-tflops`` x ``--mfu``.

``--cache`` takes ``[PATH:]SIZE[:read=GBPS][:write=GBPS][:dwpd=N|tbw=SIZE][:years=N]`` or a bare existing
``PATH`` (capacity = its filesystem size). Formulas: :mod:`aidaptiv_ds.planner.plan`.

The verdict says FITS, but also when the pace wears the drives out before their rating allows
("FITS, but wears the drives out in N days", :mod:`aidaptiv_ds.planner.wear`), with what brings the
pace within the rating; ``--strict`` makes that a refusal (exit code 1). The drives' rating comes
from ``--dwpd``/``--tbw``, the ``dwpd=``/``tbw=`` of a ``--cache``, or the ``"aidaptiv"`` section's
``endurance`` of ``--deepspeed CONFIG``; without any, 1 DWPD is assumed and the plan asks for it.
"""
from __future__ import annotations

import argparse
import json
import os

from ..planner.auto import CPU_REDUCE_BUCKET_NUMEL
from ..planner.model_size import load_model_shape, nearest_preset
from ..planner.plan import (
    DEEPSPEED_MAX_LIVE_PARAMETERS,
    DEEPSPEED_MAX_REUSE_DISTANCE,
    DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD,
    DEFAULT_READ_GBPS,
    DEFAULT_SUB_GROUP_SIZE,
    DEFAULT_WRITE_GBPS,
    MOMENT_BYTES,
    OFFLOAD_PARAM_DEVICES,
    PARAM_BYTES,
    CacheDrive,
    CapacityPlan,
    PlanInput,
    make_plan,
)
from ..planner.schedule import (
    DEFAULT_GPU,
    DEFAULT_MFU,
    DEFAULT_PCIE,
    GPU_PEAK_TFLOPS,
    LAYER_MAJOR,
    PCIE_PRESETS_GBPS,
    SCHEDULE_CHOICES,
    parse_rate,
)
from ..planner.wear import describe as describe_wear
from ..store.ledger import EnduranceRating, filesystem_capacity
from ..store.slab import free_bytes
from ..telemetry.nvml import nvml_status
from ..telemetry.sysinfo import host_memory
from ..units import format_bytes, parse_size


def _dec(n: float) -> str:
    """Bytes in decimal units, as drive vendors and ``--vram 96GB`` state them."""
    return format_bytes(n, decimal=True)


_DRIVE_KEYS = {"read": "read_gbps", "write": "write_gbps", "dwpd": "rated_dwpd", "years": "warranty_years",
               "tbw": "rated_tbw"}


def parse_cache_spec(spec: str, defaults: dict) -> CacheDrive:
    """A :class:`CacheDrive` from ``[PATH:]SIZE[:key=value...]`` or an existing ``PATH``.

    A bare ``PATH`` takes the capacity of its filesystem (for DWPD) and its free space now (for the fit).

    ``defaults`` holds ``read_gbps``, ``write_gbps``, ``rated_dwpd``, ``warranty_years`` and optionally
    ``rated_tbw`` (bytes: the rated DWPD is then ``tbw / (capacity x 365 x warranty_years)``).

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
            fields[_DRIVE_KEYS[k]] = parse_size(v, f"--cache {spec!r}: tbw") if k == "tbw" else float(v)
        except ValueError:
            raise ValueError(f"--cache {spec!r}: {k}={v!r} is not a number"
                             + (" or size (e.g. tbw=14PB)" if k == "tbw" else "")) from None
        if k == "dwpd":
            fields.pop("rated_tbw", None)  # this drive's own DWPD wins over a default --tbw
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
    tbw = fields.pop("rated_tbw", None)
    if tbw is not None:
        fields["rated_dwpd"] = tbw / (size * 365.0 * fields["warranty_years"])
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
    p.add_argument("--dram-budget", default=None, help="DRAM tier budget per node or 'auto' (default: the --deepspeed "
                   "config's aidaptiv.dram_budget x ranks per node, else auto)")
    p.add_argument("--cache", action="append", default=[], metavar="[PATH:]SIZE[:k=v]",
                   help="a cache drive (repeat per drive): 8TB, /mnt/c0:2TB, /mnt/c0:2TB:read=7:write=6:dwpd=30")
    p.add_argument("--read-gbps", type=float, help=f"default drive read GB/s (default {DEFAULT_READ_GBPS})")
    p.add_argument("--write-gbps", type=float, help=f"default drive write GB/s (default {DEFAULT_WRITE_GBPS})")
    p.add_argument("--dwpd", type=float, help="the drives' rated DWPD, from the data sheet (cache SSDs: 30-100; "
                   f"without it or --tbw: the config's endurance.rated_dwpd, else {EnduranceRating.rated_dwpd}, assumed)")
    p.add_argument("--tbw", help="the drives' rated TBW per drive instead of --dwpd, e.g. 14PB (over --warranty-years)")
    p.add_argument("--deepspeed", metavar="CONFIG", help="your DeepSpeed config: the run's settings the flags leave "
                   "out (dtype, gradient_clipping, micro-batch, accumulation, ZeRO-3 knobs, aidaptiv.dram_budget and "
                   "step_in_backward) and the drives' endurance (aidaptiv.endurance); a flag given wins")
    p.add_argument("--strict", action="store_true", help="refuse (exit code 1) a plan that fits but writes the drives "
                   "faster than their rated DWPD")
    p.add_argument("--warranty-years", type=float, help=f"default warranty (default {EnduranceRating.warranty_years})")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per GPU per micro-step (default 1)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--grad-accum", "--ga", dest="grad_accum", type=int, default=None,
                   help="gradient accumulation: micro-batches per optimizer step (default 1)")
    p.add_argument("--schedule", choices=SCHEDULE_CHOICES, default="both",
                   help="gradient-accumulation schedule to cost: micro-batch-major (what the runtime does), "
                        "layer-major (every micro-batch through a block before the next, GreedySnake), or both "
                        "side by side (default)")
    p.add_argument("--pcie-gbps", default=None, metavar="GBPS|PRESET",
                   help=f"host-device GB/s per direction per GPU for the step-time estimate, or a preset "
                        f"({', '.join(f'{k} = {v:g}' for k, v in PCIE_PRESETS_GBPS.items())}; default {DEFAULT_PCIE})")
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                   help=f"fraction of --gpu-tflops training sustains, for the step-time estimate (default "
                        f"{DEFAULT_MFU})")
    p.add_argument("--dtype", default=None, choices=sorted(PARAM_BYTES),
                   help="parameter dtype (default bf16; with --deepspeed, the config's bf16/fp16 section)")
    p.add_argument("--optimizer", default="adamw", choices=sorted(MOMENT_BYTES))
    p.add_argument("--moments", default=None, choices=("fp32", "bf16", "int8"),
                   help="format of the optimizer's moments on the tiers (aidaptiv.optimizer_state.moments; bf16 halves "
                        "them, int8 quantizes them to 1.016 B each, Adam/AdamW only; default: the --deepspeed config's, "
                        "else fp32)")
    p.add_argument("--no-activation-checkpointing", action="store_true", help="keep all activations")
    p.add_argument("--no-flash-attention", action="store_true", help="attention scores are materialised (s^2)")
    p.add_argument("--dropout", action="store_true", help="the model uses dropout (masks are stored)")
    p.add_argument("--logits-tokens", type=int, default=None, metavar="N",
                   help="tokens per micro-batch the LM head computes logits for (default micro-batch x seq-len; "
                        "fewer when the loss is taken at response tokens only, as launch/finetune.py does)")
    p.add_argument("--sub-group-size", type=float, default=None,
                   help="optimizer sub-group in elements (DeepSpeed sub_group_size; default: the config's, else what "
                        "aidaptiv_ds picks where a config leaves it out: at least 4 per rank, 3 within 5%% of a "
                        "rank's host memory)")
    p.add_argument("--gpu-tflops", default=None, metavar="TFLOPS|PRESET",
                   help=f"peak dense TFLOP/s per GPU for the compute bound, or a preset "
                        f"({', '.join(f'{k} = {v:g}' for k, v in GPU_PEAK_TFLOPS.items())}); the step-time "
                        f"estimate of the schedules uses {DEFAULT_GPU} when it is left out")
    p.add_argument("--dataset-tokens", type=float, help="tokens in one epoch (for writes per epoch and run)")
    p.add_argument("--epochs", type=float, default=1.0, help="epochs of the run (default 1)")
    p.add_argument("--step-time", type=float, help="measured seconds per step (endurance pace; default: lower bound)")
    p.add_argument("--cpu-ranks", nargs="?", type=int, const=0, default=None, metavar="N",
                   help="the ranks train on the CPU (DeepSpeed's CPU accelerator), N per node (default: --gpus if "
                        "given, else 1); no GPU flags needed: activations and gathered slices are host memory, and "
                        "there is no VRAM check")
    p.add_argument("--max-live-parameters", type=float, default=None,
                   help="DeepSpeed's stage3_max_live_parameters in elements (default 1e9, DeepSpeed's): host memory "
                        "on CPU ranks, with --max-reuse-distance")
    p.add_argument("--max-reuse-distance", type=float, default=None,
                   help="DeepSpeed's stage3_max_reuse_distance in elements (default 1e9, DeepSpeed's): DeepSpeed keeps "
                        "up to the larger of the two gathered, plus two modules and a layer")
    p.add_argument("--param-persistence-threshold", type=float, default=None,
                   help="DeepSpeed's stage3_param_persistence_threshold in elements (default 1e5, DeepSpeed's): "
                        "tensors this small stay gathered on top")
    p.add_argument("--reduce-bucket-size", type=float, default=None,
                   help="DeepSpeed's reduce_bucket_size in elements, if your config sets it (host memory on CPU "
                        "ranks: three buckets while one is reduced over several ranks, one on a single rank; left "
                        "out, a CPU rank runs with 2e7)")
    p.add_argument("--gradient-clipping", type=float, default=None,
                   help="DeepSpeed's gradient_clipping (default: the --deepspeed config's, where the config leaves it "
                        "out, and without one, DeepSpeed's 1.0, also HF Trainer's; 0: off): with it on, steps "
                        "inside backward keep their gradients until the norm is known")
    p.add_argument("--step-in-backward", choices=("auto", "true", "false"), default=None,
                   help="aidaptiv.step_in_backward (default auto: inside backward where the drives hold a second "
                        "copy of the optimizer state)")
    p.add_argument("--trainable-params", type=float, default=None, metavar="N",
                   help="parameters the optimizer updates, e.g. a LoRA run's adapters (PEFT's "
                        "print_trainable_parameters); the rest are frozen: read each step, written once, no gradient "
                        "or optimizer state (default: all)")
    p.add_argument("--offload-param", choices=OFFLOAD_PARAM_DEVICES, default=None,
                   help="zero_optimization.offload_param.device: nvme (the parameters go through aidaptiv_ds's tiers), "
                        "cpu (DeepSpeed keeps them in host memory) or none (on the GPU; host memory on CPU ranks); "
                        "default: the --deepspeed config's (left out there: none, DeepSpeed's), else nvme")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def plan_input_from_args(args) -> PlanInput:
    """The :class:`PlanInput` for parsed ``plan`` arguments; inputs taken from this host are listed in ``assumed``.

    Raises:
        ValueError: naming the flag, the value and the fix.
    """
    assumed = []
    args = _with_config_settings(args, assumed)
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
    if args.dwpd is not None and args.tbw is not None:
        raise ValueError("--dwpd and --tbw both given; give the drive's rating one way (the data sheet states both: "
                         "TBW = DWPD x capacity x 365 x warranty years)")
    endurance = args.config_endurance
    moments = args.moments or args.config_moments or "fp32"
    defaults = {"read_gbps": args.read_gbps or DEFAULT_READ_GBPS, "write_gbps": args.write_gbps or DEFAULT_WRITE_GBPS,
                "rated_dwpd": args.dwpd or endurance.get("rated_dwpd") or EnduranceRating.rated_dwpd,
                "warranty_years": args.warranty_years or endurance.get("warranty_years")
                or EnduranceRating.warranty_years}
    if args.tbw is not None:
        defaults["rated_tbw"] = parse_size(args.tbw, "--tbw")
    drives = [parse_cache_spec(s, defaults) for s in args.cache]
    specs = ":".join(args.cache)
    if args.read_gbps is None and "read=" not in specs:
        assumed.append(f"drive read GB/s ({DEFAULT_READ_GBPS}, a PCIe 4.0 NVMe figure; measure with bench-io)")
    if args.write_gbps is None and "write=" not in specs:
        assumed.append(f"drive write GB/s ({DEFAULT_WRITE_GBPS}; measure with bench-io)")
    if args.dwpd is None and args.tbw is None and "rated_dwpd" not in endurance and not all(
            "dwpd=" in c or "tbw=" in c for c in args.cache):
        assumed.append(f"rated DWPD ({EnduranceRating.rated_dwpd:g}; give the data sheet's figure: --dwpd N or --tbw SIZE)")
    _batch_from_config(args, gpus * args.nodes)
    if "sub_group_size" in args.defaulted:  # planned as the runtime picks it where the config leaves it out
        args.sub_group_size = None
    if isinstance(args.dram_budget, tuple):  # the config's per-rank budget: per node
        budget = int(args.dram_budget[0]) * gpus
    else:
        budget = None if str(args.dram_budget).lower() == "auto" else parse_size(args.dram_budget, "--dram-budget")
    tflops = parse_rate(args.gpu_tflops, GPU_PEAK_TFLOPS, "--gpu-tflops") if args.gpu_tflops is not None else None
    link = parse_rate(args.pcie_gbps, PCIE_PRESETS_GBPS, "--pcie-gbps") if args.pcie_gbps is not None else None
    if not cpu_ranks:
        if link is None:
            assumed.append(f"host-device link {PCIE_PRESETS_GBPS[DEFAULT_PCIE]:g} GB/s per GPU (preset {DEFAULT_PCIE}; "
                           f"give --pcie-gbps)")
        if tflops is None:
            assumed.append(f"GPU peak {GPU_PEAK_TFLOPS[DEFAULT_GPU]:g} TFLOP/s (preset {DEFAULT_GPU}; give "
                           f"--gpu-tflops) for the schedules' estimate")
    if args.mfu == DEFAULT_MFU and (tflops is not None or not cpu_ranks):
        assumed.append(f"training sustains {DEFAULT_MFU:g} of the peak FLOP/s (give --mfu)")
    inp = PlanInput(
        shape=shape, n_params=n_params, shape_source=source, gpus=gpus, nodes=args.nodes, vram=vram, dram=dram,
        drives=drives, dram_budget=budget, micro_batch=args.micro_batch, seq_len=args.seq_len,
        grad_accum=args.grad_accum, dtype=args.dtype, optimizer=args.optimizer,
        moments=moments,
        activation_checkpointing=not args.no_activation_checkpointing, flash_attention=not args.no_flash_attention,
        dropout=args.dropout, sub_group_size=None if args.sub_group_size is None else int(args.sub_group_size),
        gpu_flops=tflops * 1e12 if tflops else None, schedule=args.schedule, link_gbps=link, gpu_mfu=args.mfu,
        dataset_tokens=int(args.dataset_tokens) if args.dataset_tokens else None, epochs=args.epochs,
        step_time_s=args.step_time, cpu_ranks=cpu_ranks,
        max_live_parameters=int(args.max_live_parameters), max_reuse_distance=int(args.max_reuse_distance),
        param_persistence_threshold=int(args.param_persistence_threshold),
        reduce_bucket_size=int(args.reduce_bucket_size) if args.reduce_bucket_size else CPU_REDUCE_BUCKET_NUMEL, gradient_clipping=args.gradient_clipping,
        step_in_backward={"auto": "auto", "true": True, "false": False}[args.step_in_backward],
        logits_tokens=args.logits_tokens, offload_param=args.offload_param,
        trainable_params=None if args.trainable_params is None else int(args.trainable_params), assumed=assumed)
    if inp.sub_group_size is None:
        assumed.append(f"sub_group_size {inp.sub_group_numel:,} elements (left out: aidaptiv_ds picks it from a rank's "
                       f"host memory, 5% for the three sub-groups in flight; DeepSpeed's own default is 1e9; give "
                       f"--sub-group-size to plan another)")
    return inp


#: the plan's default of each setting :func:`_with_config_settings` fills (flag destination -> value)
PLAN_DEFAULTS = {"dram_budget": "auto", "micro_batch": 1, "grad_accum": 1, "dtype": "bf16",
                 "sub_group_size": DEFAULT_SUB_GROUP_SIZE, "max_live_parameters": DEEPSPEED_MAX_LIVE_PARAMETERS,
                 "max_reuse_distance": DEEPSPEED_MAX_REUSE_DISTANCE,
                 "param_persistence_threshold": DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD,
                 "reduce_bucket_size": None, "gradient_clipping": 1.0, "step_in_backward": "auto",
                 "offload_param": "nvme"}


def _with_config_settings(args, assumed: list) -> argparse.Namespace:
    """``args`` with each setting the command line left out taken from ``--deepspeed CONFIG``
    (:mod:`.plan_config`, the file read once), else the plan's default (:data:`PLAN_DEFAULTS`); a config's
    ``"auto"`` (filled by HF at run time) is named in ``assumed``. A config's ``dram_budget`` comes back as
    ``(bytes per rank,)``; its endurance and moments as ``config_endurance`` and ``config_moments``."""
    out = argparse.Namespace(**vars(args))
    given = {}
    if args.deepspeed:
        from .plan_config import read_config_settings
        cs = read_config_settings(args.deepspeed)
        given = dict(cs.values)
        if isinstance(given.get("dram_budget"), int):
            given["dram_budget"] = (given["dram_budget"],)
        if cs.unknown:
            assumed.append(f"\"auto\" in --deepspeed {args.deepspeed} (HF fills it at run time), planned with the "
                           f"defaults; give the flags: {', '.join(cs.unknown)}")
        assumed.extend(cs.notes)
    out.defaulted = set()  # settings neither a flag nor the config gave
    for dest, default in PLAN_DEFAULTS.items():
        if getattr(out, dest, None) is None:
            if dest not in given:
                out.defaulted.add(dest)
            setattr(out, dest, given.get(dest, default))
    out.train_batch_size = given.get("train_batch_size")
    if not args.cache and args.deepspeed and cs.cache_paths:  # the drives the run would use
        out.cache = list(cs.cache_paths)
        assumed.append(f"cache drives: --deepspeed {args.deepspeed}'s cache paths {', '.join(cs.cache_paths)} (each "
                       f"its filesystem's size; give --cache PATH:SIZE to plan another)")
    out.config_endurance = cs.endurance if args.deepspeed else {}
    out.config_moments = cs.moments if args.deepspeed else None
    return out


def _batch_from_config(args, ranks: int) -> None:
    """Where the config gives ``train_batch_size`` and only one of micro-batch and accumulation, the other as
    DeepSpeed derives it (``train_batch_size = micro x accumulation x ranks``)."""
    tbs = getattr(args, "train_batch_size", None)
    if not tbs:
        return
    tbs = int(tbs)
    if "grad_accum" in args.defaulted and "micro_batch" not in args.defaulted:
        args.grad_accum = max(tbs // (int(args.micro_batch) * ranks), 1)
    elif "micro_batch" in args.defaulted and "grad_accum" not in args.defaulted:
        args.micro_batch = max(tbs // (int(args.grad_accum) * ranks), 1)


def _days(x: float | None) -> str:
    if x is None or x == float("inf"):
        return "never (no writes)"
    return f"{x:,.1f} days" if x < 3650 else f"{x / 365:,.1f} years"


def _secs(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:,.2f} s" if x < 600 else f"{x / 60:,.1f} min"


def _dur(x: float | None) -> str:
    """Seconds for people: ``s`` below 10 minutes, ``min`` below 2 hours, then ``h``."""
    if x is None:
        return "n/a"
    return f"{x:,.0f} s" if x < 600 else f"{x / 60:,.1f} min" if x < 7200 else f"{x / 3600:,.2f} h"


_PARTS = (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer", "optimizer state"),
          ("activations", "boundary activations"))


def schedule_summary(p: CapacityPlan, name: str) -> str:
    """One line on schedule ``name`` of ``p.schedules``: drive bytes per optimizer step per node, where the
    boundary activations live (layer-major), the three times and the estimate (the README's planner table
    quotes these lines as printed)."""
    sc = p.schedules or {}
    c = sc[name]
    t = c["step_time"]
    line = (f"GA {c['grad_accum']}, {name}: reads {_dec(c['read_bytes_best'])} and writes {_dec(c['write_bytes'])} "
            f"per optimizer step ({c['read_bytes_best_per_param']:.1f} / {c['write_bytes_per_param']:.1f} B/param)")
    if name == LAYER_MAJOR:
        a = c["boundary_activations"]
        line += (f", boundary activations {_dec(a['bytes'])} ({_dec(a['dram'])} in DRAM, {_dec(a['drive'])} "
                 f"written and read on the drives)")
    elif c["reads"]["gradients"] or c["writes"]["gradients"]:
        line += f", gradients {_dec(c['writes']['gradients'])} written and {_dec(c['reads']['gradients'])} read"
    parts = [f"drives {_dur(t['drive_s'])}"] + ([f"link {_dur(t['link_s'])}"] if t["link_s"] is not None else []) \
        + [f"compute {_dur(t['compute_s'])}" if t["compute_s"] is not None else "compute not estimated"]
    line += (f"; {', '.join(parts)}: "
             f"about {_dur(t['estimate_s'])} per step (bound by the {t['bound_by']}; {_dur(t['serial_s'])} with no "
             f"overlap)")
    if name == LAYER_MAJOR and sc.get("layer_major_speedup"):
        line += f", {sc['layer_major_speedup']:.2f}x the speed of micro-batch-major"
    return line


def format_schedules(p: CapacityPlan) -> list[str]:
    """The schedules of ``p`` side by side (text lines; formulas: :mod:`aidaptiv_ds.planner.schedule`)."""
    sc = p.schedules
    if not sc:
        return []
    names = sc["shown"]
    r = sc["rates"]
    w = 30

    def row(label: str, cells: list[str]) -> str:
        return f"  {label:<24}" + "".join(f"{x:>{w}}" for x in cells)

    out = [f"schedules  GA {sc['grad_accum']}: drive bytes per optimizer step per node, an estimate "
           f"(aidaptiv_ds/planner/schedule.py)", row("", names)]
    for key, title in (("read_bytes_best", "drive reads"), ("write_bytes", "drive writes")):
        part = "reads" if key.startswith("read") else "writes"
        per = "read_bytes_best_per_param" if part == "reads" else "write_bytes_per_param"
        out.append(row(title, [f"{_dec(sc[n][key])} ({sc[n][per]:.1f} B/param)" for n in names]))
        for k, label in _PARTS:
            out.append(row("  " + label, [_dec(sc[n][part][k]) if sc[n][part][k] else "-" for n in names]))
    if all("rank_host_bytes" in sc[n] for n in names):  # CPU ranks: host memory besides the DRAM budget
        out.append(row("host memory per rank", [_dec(sc[n]["rank_host_bytes"]) + " + budget" for n in names]))
    out.append(row("boundary activations", [
        f"{_dec(sc[n]['boundary_activations']['bytes'])}: {_dec(sc[n]['boundary_activations']['dram'])} in DRAM"
        if n == LAYER_MAJOR else "on the GPU" if r["link_gbps"] else "in the rank's memory" for n in names]))
    if r["link_gbps"]:
        out.append(row("host->GPU / GPU->host", [f"{_dec(sc[n]['link_per_rank']['host_to_device'])} / "
                                                f"{_dec(sc[n]['link_per_rank']['device_to_host'])}" for n in names]))
    out.append(row("drives / link / compute", [" / ".join(_dur(sc[n]["step_time"][k]) for k in
                                                          ("drive_s", "link_s", "compute_s")) for n in names]))
    out.append(row("step time estimate", [f"{_dur(sc[n]['step_time']['estimate_s'])} ({sc[n]['step_time']['bound_by']})"
                                          for n in names]))
    out.append(row("  with no overlap", [_dur(sc[n]["step_time"]["serial_s"]) for n in names]))
    if not all(sc[n]["cache_fits"] for n in names):
        out.append(row("cache drives", [("hold it" if sc[n]["cache_fits"] else
                                         f"short: need {_dec(sc[n]['cache_bytes_needed'])}") for n in names]))
    drives = ", ".join(f"{d['read_gbps']:g}/{d['write_gbps']:g}" for d in r["drives"])
    link = f"link {r['link_gbps']:g} GB/s ({r['link_source']}), " if r["link_gbps"] else ""
    comp = (f"compute {r['peak_flops'] / 1e12:g} TFLOP/s x {r['mfu']:g} ({r['peak_source']})" if r["peak_flops"]
            else "compute not estimated (give --gpu-tflops)")
    out.append(f"  rates: drives {drives} GB/s read/write, {link}{comp}")
    out.append(f"  {sc['formula']}")
    out.append(f"  {sc['assumptions']}")
    out += [f"  {schedule_summary(p, n)}" for n in names]
    return out


def format_plan(p: CapacityPlan, strict: bool = False) -> str:
    """The plan as text for people (the JSON carries the same numbers); ``strict``: as ``--strict`` words
    the verdict."""
    m, i = p.model, p.inputs
    cpu = bool(i.get("cpu_ranks"))
    out = [f"model      {m['name']} ({m['model_type']}): {p.n_params:,} parameters"
           + (f", {i['trainable_params']:,} trainable (the rest frozen: read each step, never written, no optimizer "
              f"state)" if i.get("trainable_params") is not None else "")
           + ("" if m["shape_source"] == "exact" else f"; {m['shape_source']}"),
           f"run        {i['gpus']} {'CPU rank' if cpu else 'GPU'}(s) x {i['nodes']} node(s) (dp={p.dp}), "
           f"micro-batch {i['micro_batch']}, "
           f"seq {i['seq_len']}, grad-accum {i['grad_accum']}, {i['dtype']}, {i['optimizer']}, "
           f"checkpointing {'on' if i['activation_checkpointing'] else 'off'}",
           f"state      {_dec(p.total_state_bytes)} = {p.bytes_per_param:.2f} B/param "
           f"({p.state_bytes_per_param:g} B/param of training state + activations); "
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
                   f"bucket+overhead {_dec(v['reduce_bucket'] + v['overhead'])}"
                   + (f", parameter partitions {_dec(v['param_partitions'])} (offload_param none)"
                      if v.get("param_partitions") else ""))
    host = f"DRAM/node  {_dec(d['host_bytes'])}: margin {_dec(d['margin_bytes'])}, working set " \
           f"{_dec(d['working_set_bytes'])}"
    offload = i.get("offload_param", "nvme")
    if offload != "nvme" and p.tiers["parameters"]["dram"]:  # DeepSpeed's partitions in host memory
        host += (f" (of which the parameter partitions DeepSpeed keeps, offload_param {offload}, "
                 f"{_dec(p.tiers['parameters']['dram'] // max(p.dp // p.local_ranks, 1))})")
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
    params_at = ("yes" if r["params_resident"] else "no") if offload == "nvme" else \
        f"DeepSpeed's, in {'host memory' if p.tiers['parameters']['dram'] else 'VRAM'} (offload_param {offload})"
    sib = (f"inside backward (a second copy of the state on the drives, {_dec(r['shadow_bytes'])}"
           + ("; gradients consumed at once, never written)" if not i.get("gradient_clipping")
              else "; gradients kept until the clipping norm is known)")) if r.get("step_in_backward") \
        else "after backward"
    out += [host, f"optimizer  steps {sib}",
            f"resident   gradients {'yes' if r['grads_resident'] else 'no'}, parameters "
            f"{params_at}, {len(r['resident_subgroups'])} optimizer sub-group(s); "
            f"prefetch depth {p.prefetch['depth']}",
            f"per step   written {_dec(p.per_step['write_bytes'])}, read {_dec(p.per_step['read_bytes_best'])} "
            f"per node" + (f" ({_dec(p.per_step['read_bytes'])} where no read finds its bytes still in DRAM)"
                           if p.per_step['read_bytes'] != p.per_step['read_bytes_best'] else "")
            + f" ({p.per_step['write_bytes_per_param']:.2f} B/param written"
            + (f"; {_dec(p.per_step['write_bytes_if_clipped'])} on a step the clipping norm redoes"
               if p.per_step['write_bytes_if_clipped'] != p.per_step['write_bytes'] else "")
            + (f"; the steps after backward that follow it read {_dec(p.per_step['read_bytes_after_backward'])}"
               if p.per_step.get('read_bytes_after_backward', p.per_step['read_bytes_best'])
               != p.per_step['read_bytes_best'] else "")
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
    sched = format_schedules(p)
    if sched:
        out += [""] + sched
    out.append("")
    wear = p.wear
    if p.fits and wear and wear["exceeds"]:
        out.append(f"verdict    {'DOES NOT FIT (--strict): it fits' if strict else 'FITS'}, but wears the drives out in "
                   f"{_days(wear['days_to_rated_tbw'])}: {wear['dwpd']:.2f} DWPD at {wear['pace_source']} pace vs "
                   f"{wear['rated_dwpd']:g} rated" + (" (assumed)" if wear["rating_assumed"] else ""))
        out += describe_wear(wear)
    elif p.fits:
        out.append("verdict    FITS" + (f" (the drives' pace within their rated {wear['rated_dwpd']:g} DWPD"
                                        + (", assumed)" if wear["rating_assumed"] else ")") if wear else ""))
    else:
        out.append("verdict    DOES NOT FIT")
        for prob, ch in zip(p.verdict.problems, p.verdict.changes):
            out.append(f"  - {prob}")
            out.append(f"    smallest change: {ch or 'none found among the single changes tried'}")
        after = p.verdict.fits_after_changes
        if after is not None:
            out.append("  re-planned with " + ("that change" if len(p.verdict.changes) == 1 else "these changes")
                       + (": FITS" if after else ": still does not fit"))
    if wear and wear["rating_assumed"]:
        out.append("rating     the drives' rated DWPD was not given: 1 assumed, which suits no cache drive; give the "
                   "data sheet's --dwpd N or --tbw SIZE (or aidaptiv.endurance.rated_dwpd with --deepspeed)")
    if i["assumed"]:
        out.append("assumed    " + "; ".join(i["assumed"]))
    return "\n".join(out)


def accepted(p: CapacityPlan, strict: bool = False) -> bool:
    """The plan fits, and with ``strict`` also keeps the drives within their rated DWPD."""
    return p.fits and not (strict and p.wear is not None and p.wear["exceeds"])


def run(args) -> int:
    """Print the plan (text or ``--json``); exit code 0 when it fits (with ``--strict``: and keeps the drives
    within their rating), 1 otherwise."""
    p = make_plan(plan_input_from_args(args))
    print(json.dumps(p.as_dict(), indent=1) if args.json else format_plan(p, strict=args.strict))
    return 0 if accepted(p, args.strict) else 1
