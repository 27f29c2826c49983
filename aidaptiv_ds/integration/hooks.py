"""Install and uninstall the DeepSpeed hooks, with a version guard.

What :func:`install` changes in DeepSpeed 0.19.8 (all by assigning module or class attributes; no
DeepSpeed file is edited; ``docs/deepspeed-seams.md`` §8):

* ``partition_parameters.AsyncPartitionedParameterSwapper`` -> :func:`param_swapper_factory`, which
  returns DeepSpeed's own class for configs without an enabled ``"aidaptiv"`` section and our
  per-dtype process singleton otherwise;
* ``stage3.DeepSpeedZeroOptimizer_Stage3`` -> a subclass that is DeepSpeed's own class for such
  configs (see :mod:`aidaptiv_ds.integration.stage3`);
* the coordinator's NVMe prefetch -> :mod:`aidaptiv_ds.integration.prefetch` (it falls back to
  DeepSpeed's for parameters of DeepSpeed's own swapper);
* ``Init._ensure_availability_of_partitioned_params`` (every all-gather of a parameter passes it) -> a
  wrapper that first runs the optimizer updates riding the forward of those parameters
  (:mod:`aidaptiv_ds.integration.step_pipeline`);
* ``DeepSpeedEngine.save_checkpoint`` / ``load_checkpoint`` -> :mod:`aidaptiv_ds.integration.checkpointing`
  for engines on our optimizer (DeepSpeed's own methods for the others);
* ``DeepSpeedEngine._configure_zero_optimizer`` -> a wrapper that, for engines without an optimizer
  (ZeRO-Inference) on our swapper, settles residency and unpacked weights
  (:mod:`aidaptiv_ds.integration.inference`);
* ``deepspeed.initialize`` and ``deepspeed.zero.Init`` -> wrappers that validate an enabled section
  before anything is built, so a bad config fails with its message, not deep inside; with
  ``"profile": {"steps": ...}`` in the section, ``deepspeed.initialize`` then switches the engine's
  timeline on (:func:`aidaptiv_ds.telemetry.timeline.enable`).

On a DeepSpeed version other than :data:`SUPPORTED_DEEPSPEED`, only the validating wrappers are
installed, and they raise :class:`UnsupportedDeepSpeedError` for configs that enable aidaptiv_ds.
"""
from __future__ import annotations

import functools
import logging
import threading

from .config import AidaptivConfigError, load_ds_dict, section_enabled, trains, validate

log = logging.getLogger("aidaptiv_ds")

SUPPORTED_DEEPSPEED = ("0.19.8",)
_STATE: dict = {}
_LOCK = threading.RLock()


class UnsupportedDeepSpeedError(AidaptivConfigError):
    """aidaptiv_ds hooks DeepSpeed internals that only one DeepSpeed release is known to have."""


def _check_version():
    import deepspeed
    if deepspeed.__version__ not in SUPPORTED_DEEPSPEED:
        raise UnsupportedDeepSpeedError(
            f"aidaptiv_ds supports DeepSpeed {', '.join(SUPPORTED_DEEPSPEED)}; this environment has "
            f"{deepspeed.__version__}. Fix: pip install deepspeed=={SUPPORTED_DEEPSPEED[-1]}, or remove the "
            f"\"aidaptiv\" section (or set \"enabled\": false) to run DeepSpeed's own offload.")


def param_swapper_factory(ds_config, model_dtype):
    """``AsyncPartitionedParameterSwapper(ds_config, model_dtype)`` as DeepSpeed calls it
    (``partition_parameters.py:1174``): ours when the section is enabled, DeepSpeed's otherwise."""
    raw = getattr(ds_config, "_param_dict", None)
    if not section_enabled(raw):
        return _STATE["orig_param_swapper"](ds_config, model_dtype)
    from .param_swapper import AidaptivParamSwapper
    from .runtime import get_runtime
    rt = get_runtime(validate(raw))
    if rt.param_swapper is None:  # one per process; it keys partitions by their own dtype
        rt.param_swapper = AidaptivParamSwapper(rt)
    return rt.param_swapper


def _validate_if_enabled(config, training: bool | None = None):
    """The validated section of an enabled config (None for a config without one). From then on our
    errors print without a traceback if nothing catches them (:func:`.startup.quiet_errors`)."""
    ds = load_ds_dict(config)
    if section_enabled(ds):
        from .startup import quiet_errors
        quiet_errors()
        _check_version()
        cfg = validate(ds, training=training)
        from .build_locks import check_build_locks
        check_build_locks()  # before DeepSpeed's JIT builds wait on a left-over lock forever
        return cfg
    return None


def _init_distributed_as_deepspeed(orig, args, kwargs) -> None:
    """The process group, set up by the call ``deepspeed.initialize`` makes first (``__init__.py:509``,
    ``dist.init_distributed`` with the accelerator's backend, ``distributed_port`` and
    ``dist_init_required``), made before our preflight creates the runtime: the runtime's run name is
    broadcast from rank 0 when a process group exists, so every node's ranks share one run. DeepSpeed's
    own call then finds the group made (it is idempotent)."""
    import inspect

    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    try:
        bound = inspect.signature(orig).bind_partial(*args, **kwargs).arguments
    except TypeError:  # DeepSpeed raises its own error for these arguments
        return
    extra = {k: bound[k] for k in ("distributed_port", "dist_init_required") if k in bound}
    dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(), **extra)


def _wrap_initialize(orig):
    @functools.wraps(orig)
    def initialize(*args, **kwargs):
        config = kwargs.get("config") or kwargs.get("config_params")
        if config is None:
            a = kwargs.get("args", args[0] if args else None)
            config = getattr(a, "deepspeed_config", None) if a is not None else None
        # deepspeed.initialize(args, model, optimizer, ...): a client optimizer means training
        client_optimizer = kwargs.get("optimizer", args[2] if len(args) > 2 else None)
        cfg = _validate_if_enabled(config, training=True if client_optimizer is not None else None)
        if cfg is None:
            return orig(*args, **kwargs)
        from . import startup
        ds = load_ds_dict(config)
        if trains(ds, True if client_optimizer is not None else None):  # the whole job's need on the cache paths
            _init_distributed_as_deepspeed(orig, args, kwargs)  # the runtime's run name is rank 0's
            startup.preflight_job(cfg, ds, kwargs.get("model", args[1] if len(args) > 1 else None))
        out = orig(*args, **kwargs)
        startup.announce(out[0])
        from .train_batch import attach
        attach(out[0])
        if cfg.profile.steps is not None:
            from ..telemetry.timeline import enable
            enable(out[0], steps=cfg.profile.steps, run_dir=cfg.profile.dir, modules=cfg.profile.modules)
        return out
    initialize._aidaptiv_wrapped = orig
    return initialize


def _wrap_init(orig_init):
    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        config = kwargs.get("config_dict_or_path", kwargs.get("config"))
        _validate_if_enabled(config)
        return orig_init(self, *args, **kwargs)
    __init__._aidaptiv_wrapped = orig_init
    return __init__


def install() -> bool:
    """Install the hooks (idempotent). Returns True when the swapper hooks are active.

    Called by ``import aidaptiv_ds`` once DeepSpeed is imported (see :mod:`aidaptiv_ds._autoload`).
    """
    with _LOCK:
        if _STATE.get("installed"):
            return _STATE["active"]
        import deepspeed
        import deepspeed.runtime.zero.partition_parameters as pp

        _STATE["orig_initialize"] = deepspeed.initialize
        deepspeed.initialize = _wrap_initialize(deepspeed.initialize)
        _STATE["orig_zinit"] = pp.Init.__init__
        pp.Init.__init__ = _wrap_init(pp.Init.__init__)
        active = deepspeed.__version__ in SUPPORTED_DEEPSPEED
        if active:
            import deepspeed.runtime.zero.parameter_offload as po
            import deepspeed.runtime.zero.stage3 as s3
            from deepspeed.runtime.engine import DeepSpeedEngine

            from . import checkpointing, inference, prefetch, step_pipeline
            from .stage3 import make_stage3_class

            _STATE["orig_param_swapper"] = pp.AsyncPartitionedParameterSwapper
            pp.AsyncPartitionedParameterSwapper = param_swapper_factory
            _STATE["orig_stage3"] = s3.DeepSpeedZeroOptimizer_Stage3
            s3.DeepSpeedZeroOptimizer_Stage3 = make_stage3_class(s3.DeepSpeedZeroOptimizer_Stage3)
            prefetch.install(po.PartitionedParameterCoordinator)
            step_pipeline.install(pp.Init)
            checkpointing.install(DeepSpeedEngine)
            inference.install(DeepSpeedEngine)
        else:
            log.warning("aidaptiv_ds: DeepSpeed %s is not supported (%s); configs that enable aidaptiv will be "
                        "refused", deepspeed.__version__, ", ".join(SUPPORTED_DEEPSPEED))
        _STATE.update(installed=True, active=active)
        return active


def uninstall() -> None:
    """Restore every DeepSpeed attribute :func:`install` replaced (for tests and embedding)."""
    with _LOCK:
        if not _STATE.get("installed"):
            return
        import deepspeed
        import deepspeed.runtime.zero.partition_parameters as pp

        deepspeed.initialize = _STATE.pop("orig_initialize")
        pp.Init.__init__ = _STATE.pop("orig_zinit")
        if _STATE.get("active"):
            import deepspeed.runtime.zero.parameter_offload as po
            import deepspeed.runtime.zero.stage3 as s3
            from deepspeed.runtime.engine import DeepSpeedEngine

            from . import checkpointing, inference, prefetch, step_pipeline
            pp.AsyncPartitionedParameterSwapper = _STATE.pop("orig_param_swapper")
            s3.DeepSpeedZeroOptimizer_Stage3 = _STATE.pop("orig_stage3")
            prefetch.uninstall(po.PartitionedParameterCoordinator)
            step_pipeline.uninstall(pp.Init)
            checkpointing.uninstall(DeepSpeedEngine)
            inference.uninstall(DeepSpeedEngine)
        _STATE.clear()


def is_installed() -> bool:
    return bool(_STATE.get("installed"))
