"""The root of every error aidaptiv_ds raises for something a user can fix or act on.

``except aidaptiv_ds.AidaptivError`` catches them all. Each kind lives in the layer that raises it
and keeps the builtin base it had, so ``except ValueError`` / ``except OSError`` callers still work::

    AidaptivError
    ├── AidaptivConfigError (ValueError)       a config key, flag or size that cannot work   (here)
    │   └── UnsupportedDeepSpeedError          another DeepSpeed than 0.19.8   (integration/hooks.py)
    ├── DeepSpeedContractError (RuntimeError)  DeepSpeed called us outside docs/deepspeed-seams.md
    │                                          (integration/errors.py)
    ├── GradientConsumedError (RuntimeError)   DeepSpeed's state API asked for a gradient the step inside
    │                                          backward consumed (integration/errors.py)
    ├── PipelineError (RuntimeError)           an optimizer update riding the forward failed
    │                                          (integration/errors.py)
    ├── StaleBuildLockError (RuntimeError)     a torch build lock left by a killed build, on which
    │                                          DeepSpeed would wait forever (integration/build_locks.py)
    ├── UnitStateError (RuntimeError)          a tiered unit asked for a transition its state forbids (an
    │                                          owner's bug: a unit used after it left the tier; tiers/unit.py)
    ├── StorageError (RuntimeError)            cache drives                         (io/errors.py)
    │   ├── StorageIOError (OSError)           a read/write failed after retries: path, offset, errno
    │   ├── StorageFullError                   not enough space: path, bytes needed, bytes free
    │   ├── ChecksumError                      a block read back differs from what was written
    │   ├── FileWriteError (OSError)           a short or failed write of a file: path and bytes (io/errors.py)
    │   ├── CheckpointSpaceError               a checkpoint save does not fit (checkpoint/space.py)
    │   └── CheckpointPreflightError           state + a checkpoint do not fit at start (checkpoint/space.py)
    │   ├── StoreInUseError                    another live process owns the namespace (store/layout.py)
    │   └── CachePathError (ValueError)        missing / not a directory / not writable (store/layout.py)
    ├── OutOfSpace                             the extent allocator is full (store/allocator.py; the
    │                                          store turns it into StorageFullError)
    ├── LedgerError (OSError)                  the endurance ledger cannot be written (store/ledger.py)
    ├── IncompleteCheckpointError (RuntimeError)  a checkpoint whose save did not finish
    │   │                                      (checkpoint/format.py)
    │   └── ForeignCheckpointError             a complete checkpoint of DeepSpeed's own offload (not
    │                                          ours to load; no other tag offered)
    ├── ChecksumMismatch (ValueError)          a checked JSON file (rank.json, index.json, a manifest)
    │                                          whose content does not match its CRC (io/atomic.py)
    ├── KVCacheMismatchError (ValueError)      a KV cache directory written for another model, dtype,
    │                                          tokenizer or block layout (inference/block_store.py)
    ├── UnsupportedKVCacheError (ValueError)   vLLM KV cache tensors of a kind the connector does not store
    │                                          (inference/vllm/paged.py)
    ├── NvmlUnavailable                        NVML cannot be used (telemetry/nvml.py)
    └── DollyFormatError (ValueError)          a bad line of a Dolly JSONL file (finetune/data.py)

Builtin exceptions (``ValueError``, ``KeyError``, ``RuntimeError``) raised by internal APIs mean a
bug in the caller (a range outside an extent, a released slice released again), not bad input.

Warnings derive from :class:`AidaptivWarning` (``warnings.filterwarnings(..., category=...)``):
``BudgetWarning`` (a ``dram_budget`` above the memory available now), ``KVCacheWarning`` (a KV
cache ignored or a block dropped), ``DirectIOFallbackWarning``, ``LedgerWarning``,
``BuildLockWarning`` (an old build lock whose owner could not be checked).

This module imports nothing, so ``import aidaptiv_ds`` stays cheap; the other kinds are reachable as
``aidaptiv_ds.<Name>`` on first access (:mod:`aidaptiv_ds` resolves them lazily).
"""
from __future__ import annotations


class AidaptivError(Exception):
    """Base class of every error aidaptiv_ds raises for something a user can fix or act on."""


class AidaptivWarning(UserWarning):
    """Base class of aidaptiv_ds's warnings (a fallback taken, a ledger flush deferred)."""


class AidaptivConfigError(AidaptivError, ValueError):
    """A bad ``"aidaptiv"`` section, command-line flag or size, or a DeepSpeed setting that cannot work
    with it. The message names the key, the value and the fix."""


#: Where each public error and warning class lives, for ``aidaptiv_ds.<Name>`` (resolved lazily so that
#: ``import aidaptiv_ds`` imports neither torch nor DeepSpeed).
LOCATIONS = {
    "AidaptivError": "aidaptiv_ds.errors",
    "AidaptivWarning": "aidaptiv_ds.errors",
    "AidaptivConfigError": "aidaptiv_ds.errors",
    "UnsupportedDeepSpeedError": "aidaptiv_ds.integration.hooks",
    "DeepSpeedContractError": "aidaptiv_ds.integration.errors",
    "GradientConsumedError": "aidaptiv_ds.integration.errors",
    "PipelineError": "aidaptiv_ds.integration.errors",
    "UnsupportedKVCacheError": "aidaptiv_ds.inference.vllm.paged",
    "StaleBuildLockError": "aidaptiv_ds.integration.build_locks",
    "UnitStateError": "aidaptiv_ds.tiers.unit",
    "BuildLockWarning": "aidaptiv_ds.integration.build_locks",
    "StorageError": "aidaptiv_ds.io.errors",
    "StorageIOError": "aidaptiv_ds.io.errors",
    "StorageFullError": "aidaptiv_ds.io.errors",
    "ChecksumError": "aidaptiv_ds.io.errors",
    "DirectIOFallbackWarning": "aidaptiv_ds.io.engine",
    "StoreInUseError": "aidaptiv_ds.store.layout",
    "CachePathError": "aidaptiv_ds.store.layout",
    "OutOfSpace": "aidaptiv_ds.store.allocator",
    "LedgerError": "aidaptiv_ds.store.ledger",
    "LedgerWarning": "aidaptiv_ds.store.ledger",
    "IncompleteCheckpointError": "aidaptiv_ds.checkpoint.format",
    "ForeignCheckpointError": "aidaptiv_ds.checkpoint.format",
    "NvmlUnavailable": "aidaptiv_ds.telemetry.nvml",
    "DollyFormatError": "aidaptiv_ds.finetune.data",
    "BudgetWarning": "aidaptiv_ds.integration.config",
    "KVCacheMismatchError": "aidaptiv_ds.inference.block_store",
    "KVCacheWarning": "aidaptiv_ds.inference.block_store",
    "CheckpointSpaceError": "aidaptiv_ds.checkpoint.space",
    "CheckpointPreflightError": "aidaptiv_ds.checkpoint.space",
    "FileWriteError": "aidaptiv_ds.io.errors",
    "ChecksumMismatch": "aidaptiv_ds.io.atomic",
}
