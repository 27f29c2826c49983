"""``aidaptiv-ds unpack MODEL_DIR --deepspeed CONFIG``: stream an HF model's safetensors into the store, once.

Each rank's ZeRO-3 partition of every tensor goes to that rank's namespace under the config's
``aidaptiv.cache_paths`` and ``run_name`` (:mod:`aidaptiv_ds.checkpoint.unpack`). A training run
with the same ``run_name`` and ``"from_unpacked": true`` then builds its model from the config
alone (``from_config``) and takes the weights from the store. Prints the GB/s achieved next to the
raw ``O_DIRECT`` write throughput of the first cache path, measured in the same run.
"""
from __future__ import annotations

import json
import os
import tempfile

import torch

from ..checkpoint.unpack import unpack
from ..integration.config import load_ds_dict, parse_section
from ..bench.bench_io import RawBaseline
from ..io.heap import reuse_freed_host_memory
from ..units import format_bytes


def register(sub) -> None:
    p = sub.add_parser("unpack", help="stream a model's safetensors into the store, partitioned per rank",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="HF model directory with safetensors")
    p.add_argument("--deepspeed", required=True, help="the DeepSpeed JSON config of the training run")
    p.add_argument("--world-size", type=int, default=1, help="ranks of the training run (default 1)")
    p.add_argument("--run-name", help="namespace (default: aidaptiv.run_name of the config; required somewhere)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def dtype_of(ds: dict) -> torch.dtype:
    """The training run's parameter dtype from its DeepSpeed config (bf16 / fp16 sections, else fp32)."""
    if (ds.get("bf16") or {}).get("enabled") is True:
        return torch.bfloat16
    if (ds.get("fp16") or {}).get("enabled") is True:
        return torch.float16
    return torch.float32


def run(args) -> int:
    ds = load_ds_dict(args.deepspeed)
    if ds is None:
        raise ValueError(f"--deepspeed {args.deepspeed!r}: no such JSON file")
    cfg = parse_section(ds.get("aidaptiv", {}))
    run_name = args.run_name or cfg.run_name
    if run_name == "auto":
        raise ValueError("the unpacked store needs a name the training run can find: pass --run-name NAME and set "
                         "\"run_name\": \"NAME\", \"from_unpacked\": true in the aidaptiv section")
    paths = cfg.cache_paths or [((ds.get("zero_optimization") or {}).get("offload_param") or {}).get("nvme_path")]
    if not paths or not paths[0]:
        raise ValueError("--deepspeed: no aidaptiv.cache_paths and no offload_param.nvme_path to unpack to")
    if args.world_size < 1:
        raise ValueError(f"--world-size {args.world_size}: must be >= 1")
    reuse_freed_host_memory()
    res = unpack(args.model, paths, run_name, args.world_size, dtype_of(ds), weights=cfg.path_weights,
                 placement=cfg.placement, stripe_unit=cfg.stripe_unit)
    raw = None
    probe = min(max(res.bytes_written, 64 << 20), 1 << 30)
    with tempfile.NamedTemporaryFile(dir=paths[0], prefix=".unpack-raw-") as f:
        try:
            raw = RawBaseline(f.name, probe).run(write=True, block=8 << 20)
        except (RuntimeError, OSError) as e:
            raw = f"not measured: {e}"
    out = {"run_name": run_name, "world_size": res.world_size, "tensors": res.tensors,
           "bytes_written": res.bytes_written, "seconds": round(res.seconds, 3), "unpack_gbps": round(res.gbps, 3),
           "raw_write_gbps": raw if isinstance(raw, str) else round(raw, 3),
           "ratio_to_raw": round(res.gbps / raw, 3) if isinstance(raw, float) and raw > 0 else None}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"unpacked {res.tensors} tensors ({format_bytes(res.bytes_written)}) for {res.world_size} rank(s) into "
              f"run {run_name!r} on {', '.join(os.path.abspath(p) for p in paths)}: {res.gbps:.2f} GB/s "
              f"(raw O_DIRECT write {out['raw_write_gbps']} GB/s)")
    return 0
