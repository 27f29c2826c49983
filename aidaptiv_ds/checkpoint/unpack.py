"""Unpack: stream an HF model's safetensors into the store, partitioned per rank, once.

A training run with ``"aidaptiv": {"run_name": NAME, "from_unpacked": true}`` then takes its
initial weights from the store instead of reading (and re-partitioning) the safetensors again.

Layout: for every rank ``r`` of ``world_size``, under the namespace ``(host, NAME, rank r)`` of the
cache paths, a packed region ``unpacked/<dtype>`` holds, tensor after tensor in file order, rank
``r``'s ZeRO-3 partition of each tensor: elements ``[r P, (r + 1) P)`` of the flattened tensor with
``P = ceil(numel / world_size)`` (zero padded, DeepSpeed's partitioning), and
``<rank dir>/unpacked.json`` maps each tensor name to its place. The store index is kept.

Memory: one tensor at a time is read (``safetensors.safe_open``) and cast to the target dtype; its
partitions are staged and written asynchronously, at most ``MAX_INFLIGHT`` bytes in flight, so
peak RSS stays under twice the largest tensor plus a fixed margin (the interpreter, torch, the
bounded staging). Each partition starts on a block boundary, so writes never wait on each other.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import time

import torch
from safetensors import safe_open

from ..io.atomic import ChecksumMismatch, read_json_checked, write_json
from ..io.engine import IOEngine
from ..store.layout import Namespace
from ..store.packed import PackedRegion
from ..store.store import PathSpec, SlabStore

MANIFEST = "unpacked.json"
MAX_INFLIGHT = 256 << 20  # bytes of partitions being written at once (their staging is what unpack holds)


def region_name(dtype: torch.dtype) -> str:
    return "unpacked/" + str(dtype).replace("torch.", "")


@dataclasses.dataclass
class UnpackResult:
    """What an unpack wrote: tensors, bytes (all ranks, partitions incl. padding), seconds, GB/s."""
    tensors: int
    bytes_written: int
    seconds: float
    world_size: int
    run_name: str

    @property
    def gbps(self) -> float:
        return self.bytes_written / self.seconds / 1e9 if self.seconds > 0 else 0.0


def safetensors_files(model_dir: str) -> list[str]:
    """The safetensors shards of an HF model directory, in index order when there is an index.

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``model_dir``.
    """
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = list(dict.fromkeys(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, f) for f in files]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"aidaptiv-ds unpack: no *.safetensors in {model_dir}; give an HF model directory "
                                f"saved with safetensors (save_pretrained(..., safe_serialization=True))")
    return files


def unpack(model_dir: str, cache_paths: list[str], run_name: str, world_size: int, dtype: torch.dtype,
           weights: list[float] | None = None, placement: str = "striped", stripe_unit: int = 1 << 20,
           io_threads: int = 4) -> UnpackResult:
    """Write every tensor of ``model_dir`` into the stores of ranks ``0..world_size-1`` (see module docstring).

    Raises:
        StoreInUseError: a training run or another unpack holds one of the namespaces.
        StorageFullError: the cache paths cannot hold the partitions (nothing is half-written: the
            region grows before each write).
    """
    engine = IOEngine(threads_per_drive=io_threads)
    weights = weights or [1.0] * len(cache_paths)
    stores, regions, manifests = [], [], []
    try:
        for r in range(world_size):
            st = SlabStore(Namespace(cache_paths, run_name, r), [PathSpec(p, w) for p, w in zip(cache_paths, weights)],
                           engine=engine, policy=placement, primary=r % len(cache_paths), stripe_unit=stripe_unit,
                           keep=True)
            stores.append(st)
            regions.append(PackedRegion(st, region_name(dtype)))
            manifests.append({"dtype": str(dtype).replace("torch.", ""), "world_size": world_size, "rank": r,
                              "source": os.path.abspath(model_dir), "tensors": {}})
        elsize = dtype.itemsize
        t0 = time.perf_counter()
        written = n = 0
        inflight: list = []  # (future, bytes): writes are pipelined up to MAX_INFLIGHT bytes
        for path in safetensors_files(model_dir):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name).to(dtype).reshape(-1)
                    numel = t.numel()
                    part = -(-numel // world_size)
                    futs = []
                    for r, region in enumerate(regions):
                        lo, hi = min(r * part, numel), min((r + 1) * part, numel)
                        # block-aligned starts: no two tensors share a block, so writes never wait on each other
                        start = region.append(part * elsize, align=region.block)

                        def fill(view, lo=lo, hi=hi):
                            out = view.view(dtype)
                            out[: hi - lo].copy_(t[lo:hi])
                            out[hi - lo:].zero_()

                        inflight.append((region.write(start, part * elsize, fill)[0], part * elsize))
                        manifests[r]["tensors"][name] = {"start": start, "numel": numel, "partition_numel": part,
                                                          "shape": list(f.get_slice(name).get_shape())}
                    while sum(b for _, b in inflight) > MAX_INFLIGHT:
                        inflight.pop(0)[0].wait()
                    written += part * elsize * world_size
                    n += 1
                    del t
        for fu, _ in inflight:
            fu.wait()
        for region in regions:
            region.flush()
        seconds = time.perf_counter() - t0
        for st, region, man in zip(stores, regions, manifests):
            man["region_size"] = region.size
            write_json(os.path.join(st.ns.rank_dir(0), MANIFEST), man, checked=True, indent=None)
        return UnpackResult(n, written, seconds, world_size, run_name)
    finally:
        for st in stores:
            st.close(keep=True)
        engine.close()


def read_manifest(rank_dir: str) -> dict:
    """The ``unpacked.json`` of one rank's namespace directory.

    Raises:
        FileNotFoundError: naming the directory and the command that creates it.
        ValueError: the manifest was changed or damaged after it was written (its CRC does not match).
    """
    path = os.path.join(rank_dir, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"aidaptiv_ds: {path} does not exist: this run namespace was not unpacked. Fix: run "
                                f"`aidaptiv-ds unpack MODEL_DIR --deepspeed CONFIG` with the same cache_paths and "
                                f"run_name, or remove \"from_unpacked\" from the aidaptiv section")
    try:
        return read_json_checked(path, required=False)  # manifests before self_crc32 are read unchecked
    except ChecksumMismatch as e:
        raise ValueError(f"aidaptiv_ds: {e}. The unpacked store cannot be trusted. Fix: run `aidaptiv-ds unpack` "
                         f"again for this run_name (after `aidaptiv-ds gc --delete --run NAME`)") from None
