"""Session-wide test environment, and the test tiers.

**Tiers.** Every test has one of ``unit``, ``engine``, ``subprocess``, ``multirank``, ``benchmark``
(``slow`` is orthogonal):

* ``engine``: builds a DeepSpeed engine or ``deepspeed.zero.Init`` in the test process;
* ``subprocess``: starts a child process (a training script, a CLI, ``dd``, a crash helper);
* ``multirank``: launches several ranks (gloo); implies ``subprocess``;
* ``benchmark``: pytest-benchmark suites (``tests/bench/``; timings, not checks of behaviour);
* ``unit``: everything else, assigned here to every test that carries none of these markers.

The default is checked, not trusted: while a ``unit`` test runs (its fixtures included), starting a
child process or building a DeepSpeed engine / ``zero.Init`` fails the test with the marker to add
(``pytestmark = pytest.mark.subprocess`` for a file, ``@pytest.mark.engine`` for one test). Short
system probes some libraries run (``ldconfig`` for ``ctypes.util.find_library``, ``uname``,
compilers probed by DeepSpeed's op builders) are allowed, see :data:`PROBES`. So
``python -m pytest -m unit`` is the fast tier (in-process, no DeepSpeed engine), whoever wrote the test.

**The default run stays under CI's half hour.** ``python -m pytest -m "not slow" -n 2 --dist loadfile`` is what
CI runs on a 2-core machine (two pytest-xdist workers, each file on one: oracle results cached per argument list
stay within a worker). The heavier variants of cases that a lighter variant already covers in the default
run (another world size, another clipping mode, another launcher) are moved to ``slow`` here, by
node id in :data:`SLOW_VARIANTS` with the covering test named; ``python -m pytest -m slow`` runs them
(``tests/test_tiers.py`` checks that every listed test still exists).

**Tools of child processes.** Child processes (training runs, launchers) find the venv's tools
first: DeepSpeed JIT-builds a small comm op per process into the shared torch-extensions cache, and
two ``ninja`` versions (the venv's and the system's) treat each other's build log as stale and
rebuild it in turn (about a minute each), so every process must see the same one.

**One torch-extensions directory, built before the first test.** On the CPU accelerator every
``deepspeed.initialize`` (in ``init_distributed``) JIT-builds ``deepspeed_shm_comm`` into
``$TORCH_EXTENSIONS_DIR`` under torch's ``FileBaton``: a ``lock`` file that a second process waits on
*forever* while it exists. A build killed half-way (a test's subprocess timeout, a session ended
mid-build) leaves that file behind, and every later DeepSpeed process of every later run then hangs
until its test's timeout (seen: a CI run that did not finish in 90 minutes). So the session exports one
directory per venv (:data:`EXT_DIR`, inherited by every child), and before the first test, holding an
``flock`` that concurrent sessions share, removes a left-over ``lock`` and builds the op once in a
child process of its own (about a minute the first time; a no-op after). No test then builds under
a timeout.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.abc
import multiprocessing.util
import os
import subprocess
import sys
import tempfile

import pytest

_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")

#: the session's torch-extensions directory, exported to every child (see the module docstring)
EXT_DIR = os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(
    tempfile.gettempdir(), "aidaptiv_ds_torch_extensions_" + hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]))
#: each pytest-xdist worker, and every child it starts, draws rendezvous ports from its own slice of the range
#: (aidaptiv_ds/ports.py, [Note: a slice per process tree]): two workers never hand out the same port
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    os.environ["AIDAPTIV_PORT_SLICE"] = (f"{int(os.environ['PYTEST_XDIST_WORKER'][2:])}/"
                                         f"{int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1'))}")
#: DeepSpeed's op that every CPU-accelerator process JIT-builds at ``deepspeed.initialize``
_PREBUILD = """
import deepspeed.ops
from deepspeed.accelerator import get_accelerator
b = get_accelerator().create_op_builder("ShareMemCommBuilder")
if b is not None and deepspeed.ops.__compatible_ops__.get(b.NAME, False):
    b.load(verbose=False)
"""


def clear_stale_build_locks(ext_dir: str) -> list[str]:
    """Remove torch's ``FileBaton`` files in ``ext_dir`` that no running build owns (found by the product's
    own scan, :func:`aidaptiv_ds.integration.build_locks.find_build_locks`, at any age: the session holds
    the ``flock`` under which all its builds run) and return their paths."""
    from aidaptiv_ds.integration.build_locks import find_build_locks

    removed = []
    for lock in find_build_locks(ext_dir):
        if lock.building is not True:
            os.unlink(lock.path)
            removed.append(lock.path)
    return removed


def _prebuild_extensions() -> None:
    """Remove left-over FileBaton locks in :data:`EXT_DIR` and build DeepSpeed's comm op once."""
    os.makedirs(EXT_DIR, exist_ok=True)
    with open(os.path.join(EXT_DIR, ".aidaptiv_tests.flock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)        # other sessions build here only while holding it
        for stale in clear_stale_build_locks(EXT_DIR):
            print(f"tests/conftest.py: removed a left-over torch build lock {stale}", file=sys.stderr)
        try:
            r = subprocess.run([sys.executable, "-c", _PREBUILD], capture_output=True, text=True, timeout=1200)
        except subprocess.TimeoutExpired:
            print("tests/conftest.py: building deepspeed_shm_comm took over 20 minutes; tests that start "
                  "DeepSpeed will build it themselves", file=sys.stderr)
            return
        if r.returncode != 0:
            print(f"tests/conftest.py: building deepspeed_shm_comm failed (rc {r.returncode}); tests that start "
                  f"DeepSpeed will report it:\n{r.stderr[-2000:]}", file=sys.stderr)


TIERS = ("engine", "subprocess", "multirank", "benchmark")
#: programs a library may run as a short probe inside a unit test (basename of argv[0]); ``openssl``: torch
#: inductor's checksum of its precompiled header (``codecache._get_file_checksum``), when the fused Adam tile
#: compiles (``tiers/fused_adam.py``)
PROBES = {"ldconfig", "uname", "gcc", "cc", "c++", "g++", "clang", "nvcc", "nvidia-smi", "lscpu", "which",
          "hipcc", "rocm-smi", "ld", "ar", "openssl"}

_current: dict = {"item": None}


class TierViolation(Exception):
    """A test classified ``unit`` started a child process or built a DeepSpeed engine."""


def _violate(what: str, marker: str) -> None:
    item = _current["item"]
    if item is not None:
        raise TierViolation(f"{item.nodeid} is a unit test (no tier marker) but {what}. Mark it "
                            f"@pytest.mark.{marker} (or pytestmark = pytest.mark.{marker} for the file); "
                            f"see tests/conftest.py")


def _inductor_isa_probe(args) -> bool:
    """torch inductor's check that a compiled ISA probe loads (``torch/_inductor/cpu_vec_isa.py``
    ``_probe_load``: ``python -c "...cdll.LoadLibrary(...)"``, once per process), run by the fused Adam tile's
    first compile (``tiers/fused_adam.py``): a library's short probe like those of :data:`PROBES`."""
    argv = [] if isinstance(args, (str, bytes)) else list(args)
    return len(argv) == 3 and argv[1] == "-c" and "cdll.LoadLibrary(" in str(argv[2])


def _guard_processes() -> None:
    orig_execute = subprocess.Popen._execute_child

    def _execute_child(self, args, executable, *rest, **kw):
        argv0 = executable or (args if isinstance(args, (str, bytes)) else list(args)[0])
        name = os.path.basename(os.fsdecode(argv0)).split()[0]
        if name not in PROBES and not _inductor_isa_probe(args):
            _violate(f"starts a child process ({name})", "subprocess")
        return orig_execute(self, args, executable, *rest, **kw)

    subprocess.Popen._execute_child = _execute_child

    def guarded(mod, name, what):
        orig = getattr(mod, name, None)
        if orig is None:
            return

        def wrapper(*a, **kw):
            _violate(what, "subprocess")
            return orig(*a, **kw)
        setattr(mod, name, wrapper)

    guarded(os, "fork", "forks (os.fork / multiprocessing)")
    guarded(os, "system", "runs os.system")
    guarded(os, "posix_spawn", "spawns a process")
    guarded(os, "posix_spawnp", "spawns a process")
    guarded(multiprocessing.util, "spawnv_passfds", "starts a multiprocessing child")


def _wrap_init(cls, what: str) -> None:
    orig = cls.__init__
    if getattr(orig, "_tier_guard", False):
        return

    def __init__(self, *a, **kw):
        _violate(what, "engine")
        return orig(self, *a, **kw)
    __init__._tier_guard = True
    __init__.__wrapped__ = orig
    cls.__init__ = __init__


_ENGINE_CLASSES = {"deepspeed.runtime.engine": ("DeepSpeedEngine", "builds a DeepSpeed engine"),
                   "deepspeed.runtime.zero.partition_parameters": ("Init", "enters deepspeed.zero.Init")}


class _EngineGuard(importlib.abc.MetaPathFinder):
    """Wraps ``DeepSpeedEngine.__init__`` and ``zero.Init.__init__`` as soon as their modules load."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _ENGINE_CLASSES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module, _run=run):
            _run(module)
            cls_name, what = _ENGINE_CLASSES[module.__name__]
            _wrap_init(getattr(module, cls_name), what)

        spec.loader.exec_module = exec_module
        return spec


def _warm_matplotlib_font_cache() -> None:
    """Build matplotlib's font cache once, before the first test: its first import on a machine runs
    ``fc-list`` to list the fonts, which inside a unit test that draws (the report, the timeline) is a
    child process the tier guard refuses; on a fresh machine the first such test failed."""
    try:
        from matplotlib import font_manager  # noqa: F401  (writes <cache dir>/fontlist-*.json)
    except ImportError:
        pass


def pytest_sessionstart(session):
    # the vLLM tests (-m vllm, in the vllm venv) start no DeepSpeed process: no comm op to build. Under pytest-xdist
    # the controller builds it before it starts the workers (its session starts first); a worker started again
    # after a crash must not remove the lock a build of the other worker's child holds
    if hasattr(session.config, "workerinput"):
        return
    if not session.config.option.collectonly and session.config.option.markexpr.strip() != "vllm":
        _prebuild_extensions()
        _warm_matplotlib_font_cache()


def pytest_configure(config):
    _guard_processes()
    for name, (cls_name, what) in _ENGINE_CLASSES.items():
        if name in sys.modules:
            _wrap_init(getattr(sys.modules[name], cls_name), what)
    sys.meta_path.insert(0, _EngineGuard())


#: node id -> the default-run test that covers the same behaviour (see the module docstring)
SLOW_VARIANTS = {
    "tests/test_multirank.py::test_narrow_moments_on_two_ranks[int8-0.025]":
        "test_narrow_moments_on_two_ranks[bf16-0.01] (the same two-rank narrow-slot path) and "
        "test_int8_moments.py (the int8 codes on one rank)",
    "tests/test_moment_dtype.py::test_bf16_moments_resume_exactly":
        "test_int8_moments.py::test_int8_moments_resume_exactly (a narrow-moment checkpoint resumed bit-exactly)",
    "tests/test_moment_dtype.py::test_engine_with_bf16_moments_matches_rounded_oracle[clip0-dram]":
        "test_engine_with_bf16_moments_matches_rounded_oracle[bf16-model-riding] (the same layout and step; here in "
        "DRAM)",
    "tests/test_moment_dtype.py::test_engine_with_bf16_moments_matches_rounded_oracle[clip1-ga2]":
        "test_int8_moments.py::test_engine_with_int8_moments_matches_round_tripped_oracle (narrow slots stepped "
        "through the same tiles, clipping 1.0, GA 2, redone steps) and [bf16-model-riding] (the bf16 slots)",
    "tests/test_checkpoint.py::test_a_save_dir_per_rank_saves_parts_and_resumes_bit_identical":
        "tests/test_two_nodes.py (the same with two nodes in network namespaces; this one runs where those "
        "cannot be made)",
    "tests/test_checkpoint.py::test_resume_is_bit_identical[2]": "test_resume_is_bit_identical[1]",
    "tests/test_checkpoint.py::test_resume_with_another_world_size[2-1]": "test_multirank.py world-size reads",
    "tests/test_checkpoint.py::test_resume_with_another_world_size[1-2]": "test_resume_with_another_world_size "
                                                                        "in the slow tier only (2 x 80 s)",
    "tests/test_deepspeed_cases.py::test_fp32_with_default_buffer_settings": "test_unaligned_element_counts",
    "tests/test_deepspeed_cases.py::test_second_engine_on_the_same_path_leaves_the_first_intact":
        "test_store.py::test_second_owner_is_refused_*",
    "tests/test_deepspeed_cases.py::test_partition_larger_than_buffer_size": "test_unaligned_element_counts",
    "tests/test_deepspeed_cases.py::test_parameter_requested_again_while_resident[ckpt_reentrant]":
        "test_parameter_requested_again_while_resident[tied]",
    "tests/test_deepspeed_cases.py::test_parameter_requested_again_while_resident[called_twice]":
        "test_duplicate_parameters_in_one_swap_in",
    "tests/test_deepspeed_cases.py::test_parameter_requested_again_while_resident[ckpt_nonreentrant]":
        "test_parameter_requested_again_while_resident[tied]",
    "tests/test_gradient_semantics.py::test_no_gradient_means_zero_never_stale[ws2-ga1-noclip]":
        "[ws2-ga2-clip]",
    "tests/test_gradient_semantics.py::test_no_gradient_means_zero_never_stale[ga2-noclip]": "[ga2-clip]",
    "tests/test_gradient_semantics.py::test_no_gradient_means_zero_never_stale[ga2-clip-after-backward]":
        "test_step_in_backward.py [fp32-clip-some-steps] (its steps after a clipped one run after backward)",
    "tests/test_gradient_semantics.py::test_no_gradient_means_zero_never_stale[ga2-clip-subgroups-budget]":
        "[ws2-ga2-clip] (sub-groups)",
    "tests/test_gradient_semantics.py::test_no_gradient_means_zero_never_stale[ga1-noclip]": "[ga2-clip]",
    "tests/test_gradient_semantics.py::test_no_gradient_means_zero_never_stale[ga1-clip]": "[ga2-clip]",
    "tests/test_gradient_semantics.py::test_deepspeeds_own_handling_differs": "docs/gradients.md (what it shows)",
    "tests/test_finetune_e2e.py::test_bf16_run_saves_bf16_safetensors_that_reload":
        "test_stories260k_on_dolly_saves_a_model_that_reproduces_the_eval_loss",
    "tests/test_finetune_e2e.py::test_deepspeed_launcher_single_rank_matches_the_single_process_run":
        "test_finetune_accounting.py (both launchers, 2 ranks)",
    "tests/test_finetune_e2e.py::test_aidaptiv_configs_train_like_dram_offload[aidaptiv_zero3_multi.json-2]":
        "test_finetune_accounting.py (2 ranks)",
    "tests/test_finetune_e2e.py::test_aidaptiv_configs_train_like_dram_offload[aidaptiv_zero3.json-1]":
        "test_stories260k_on_dolly_saves_a_model_that_reproduces_the_eval_loss",
    "tests/test_finetune_e2e.py::test_native_nvme_config_trains_through_the_python_aio_handle_like_dram_offload":
        "test_aio_handle.py",
    "tests/test_finetune_resume.py::test_killed_after_step_4_resumes_from_latest":
        "test_resume_from_checkpoint_3_continues_bit_for_bit",
    "tests/test_generate.py::test_generate_with_zero_inference_weights_on_the_cache_path":
        "test_zero_inference.py",
    "tests/test_generate.py::test_generate_reuses_the_prefix_from_dram_then_from_the_drive_after_a_restart":
        "test_kv_cache.py (the same flow in process) and test_bad_prompt_file_and_foreign_kv_cache_are_named",
    "tests/test_checkpoint_crash.py::test_kill_9_during_a_resave_of_a_tag[after_deepspeed-old-True]":
        "test_kill_9_during_a_resave_of_a_tag[after_switch-new-False]",
    "tests/test_deepspeed_cases.py::test_parameter_requested_again_while_resident[tied]":
        "test_duplicate_parameters_in_one_swap_in",
    "tests/test_gradient_semantics.py::test_no_gradient_means_zero_never_stale[ws2-ga2-clip]": "[ga2-clip]",
    "tests/test_multirank.py::test_two_runs_at_once_with_auto_names_both_train_correctly":
        "test_store.py owner locks",
    "tests/test_multirank.py::test_second_run_with_the_same_name_refuses_and_the_first_is_unaffected":
        "test_store.py::test_second_owner_is_refused_*",
    "tests/test_multirank.py::test_two_nodes_with_the_deepspeed_launcher_and_a_hostfile":
        "test_two_nodes_with_torchrun_c10d_on_localhost",
    "tests/test_multirank.py::test_write_back_of_one_rank_does_not_starve_another_ranks_reads":
        "test_oracle_world_size_2_torchrun",
    "tests/test_multirank.py::test_oracle_world_size_2_deepspeed_launcher": "test_oracle_world_size_2_torchrun",
    "tests/test_oracle.py::test_real_stories260k_from_pretrained_under_zero3[bf16-1]":
        "test_bit_identical_with_cpu_offload[llama-tied-bf16-ga2-budget0]",
    "tests/test_oracle.py::test_real_stories260k_from_pretrained_under_zero3[fp32-2]":
        "test_multirank.py::test_oracle_world_size_2_torchrun",
    "tests/test_oracle.py::test_bit_identical_with_cpu_offload[llama-tied-bf16-zinit-half]":
        "test_step_in_backward.py (half the state)",
    "tests/test_oracle.py::test_bit_identical_with_cpu_offload[mlp-fp32-ga2-subgroups]":
        "test_step_in_backward.py (sub-groups)",
    "tests/test_oracle.py::test_bit_identical_with_cpu_offload[mlp-zinit-bf16-unused-param]":
        "test_gradient_semantics.py::test_no_gradient_means_zero_never_stale[ga2-clip]",
    "tests/test_oracle.py::test_bytes_written_per_param_gradient_sized_budget":
        "test_plan_vs_measurement.py (a budget holding the parameters)",
    "tests/test_oracle.py::test_bytes_written_per_param_half_state": "test_plan_vs_measurement.py",
    "tests/test_step_in_backward.py::test_step_in_backward_is_bit_identical[fp32-noclip-ga1-budget0]":
        "test_no_gradient_written_when_stepped_in_backward",
    "tests/test_step_in_backward.py::test_step_in_backward_is_bit_identical[bf16-clip-always-triggers-ga2]":
        "[fp32-clip-some-steps]",
    "tests/test_step_in_backward.py::test_step_in_backward_is_bit_identical[fp32-noclip-ga4-half]":
        "[bf16-noclip-ga2-budget0]",
    "tests/test_step_in_backward.py::test_step_in_backward_is_bit_identical[fp32-clip-never-triggers]":
        "test_plan_vs_measurement.py[0-1000000.0]",
    "tests/test_training_faults.py::test_filesystem_without_fallocate_filled_mid_run_stops_and_the_checkpoint_resumes":
        "test_enospc_mid_run_stops_and_the_earlier_checkpoint_resumes",
    "tests/test_training_faults.py::test_transient_eio_within_the_retry_budget_recovers[read]": "[write]",
    "tests/test_training_faults.py::test_eio_fails_after_the_retries_naming_slab_offset_and_drive[read]": "[write]",
    "tests/test_training_faults.py::test_drive_filled_by_another_writer_mid_run_does_not_stop_training":
        "test_enospc_mid_run_stops_and_the_earlier_checkpoint_resumes",
    "tests/test_unpack.py::test_training_starts_from_the_unpacked_store":
        "test_zero_inference.py::test_weights_from_an_unpacked_store_are_never_written",
    "tests/test_plan_vs_measurement.py::test_planned_writes_match_the_ledger[524160-0.0]": "[0-0.0]",
    "tests/test_plan_vs_measurement.py::test_planned_reads_match_the_ledger[bf16]": "[fp32]",
    "tests/test_training_faults.py::test_a_failed_write_waited_for_several_times_keeps_one_traceback":
        "test_after_a_failed_write_the_run_can_neither_go_on_nor_checkpoint",
    "tests/test_training_faults.py::test_transient_eio_within_the_retry_budget_recovers[write]":
        "test_io_engine.py retries (in process)",
    "tests/test_training_faults.py::test_store_directory_removed_mid_run":
        "test_a_store_removed_and_re_created_by_another_owner_is_not_deleted_at_close",
    "tests/test_training_faults.py::test_filesystem_turning_read_only_mid_run":
        "test_enospc_mid_run_stops_and_the_earlier_checkpoint_resumes",
    "tests/test_training_faults.py::test_filesystem_without_o_direct_falls_back_with_one_warning":
        "test_io_engine.py::test_direct_io_used_when_aligned_and_buffered_otherwise",
    "tests/test_space.py::test_a_dead_store_that_fills_the_drive_is_named_with_gc": "test_gc.py",
    "tests/test_space.py::test_checkpoints_on_the_cache_drive_fit_beside_the_slab":
        "test_the_slab_is_the_state_plus_the_stated_margin[32]",
    "tests/test_zero_inference.py::test_weights_that_fit_the_budget_are_read_once":
        "test_budget0_streams_the_weights_and_matches_the_plain_model",
    "tests/test_zero_inference.py::test_model_partitioned_by_deepspeed_initialize":
        "test_budget0_streams_the_weights_and_matches_the_plain_model",
    "tests/test_multirank.py::test_affinity_is_oracle_equal": "test_striped_is_oracle_equal",
    "tests/test_multirank.py::test_affinity_fills_the_primary_then_spills_to_the_others":
        "test_striping.py (affinity placement, in process)",
    "tests/test_multirank.py::test_affinity_every_rank_reads_back_after_a_restart":
        "test_striped_every_rank_reads_back_after_a_restart",
    "tests/test_multirank.py::test_two_nodes_with_torchrun_c10d_on_localhost": "test_oracle_world_size_2_torchrun",
    "tests/test_hooks.py::test_deepspeed_classes_without_an_enabled_section[absent]": "[disabled]",
    "tests/test_step_in_backward.py::test_step_after_backward_when_switched_off":
        "[fp32-clip-some-steps] (its steps after a clipped one run after backward, bit-identical)",
    "tests/test_plan_vs_measurement.py::test_planned_writes_match_the_ledger[0-1000000.0]": "[0-0.0]",
    "tests/test_compare.py::test_compare_end_to_end_tiny":
        "the summary, table and watchdog tests of test_compare.py (in process); the GPU check's CPU smoke run",
    "tests/test_checkpoint.py::test_a_refused_checkpoint_is_named_and_only_complete_ones_are_offered":
        "test_checkpoint_format.py::test_the_refused_tag_is_not_offered_and_the_previous_one_is",
    "tests/test_unpack.py::test_world_size_mismatch_is_named": "test_unpack_streams_one_tensor_at_a_time",
    "tests/test_deepspeed_cases.py::test_duplicate_parameters_in_one_swap_in":
        "test_param_swapper_unit.py (duplicates in a request)",
    # CI at 2536 s on its machine (2026-12-07), over the half hour: the heaviest variants whose ground a lighter
    # test of the default run covers (durations from `pytest --durations=0` on the 2-core VM, seconds)
    "tests/test_multirank.py::test_narrow_moments_on_two_ranks[int8-0.025]":  # 54 s
        "[bf16-0.01] (narrow slots over two ranks) and test_int8_moments.py (int8 blocks and scales on one rank)",
    "tests/test_drop_in.py::test_fuzz_sample[llama-ws2]": "[gpt2_ckpt-ws2] (two ranks) and [llama-ws1]",  # 31 s
    "tests/test_drop_in.py::test_fuzz_sample[qwen2_ckpt-ws2]":  # 26 s
        "[gpt2_ckpt-ws2] (two ranks, activation checkpointing) and [qwen2-ws1]",
    "tests/test_moment_dtype.py::test_bf16_moments_resume_exactly":  # 29 s
        "test_int8_moments.py::test_int8_moments_resume_exactly (narrow slots through the same save and load)",
    "tests/test_oracle.py::test_reduce_bucket_size_changes_no_arithmetic[llama-bf16-ga2-bucket70000]":  # 15 s
        "[llama-fp32-clip-bucket5000]",
    "tests/test_layer_major.py::test_train_batch_is_bit_identical_with_cpu_offload[llama-tied-fp32-ga2]":  # 15 s
        "[llama-tied-fp32-ga8-clip-budget]",
    "tests/test_layer_major.py::test_train_batch_two_ranks[qwen2-tied-bf16-ga4-clip-defaults]":  # 18 s
        "[llama-ckpt-fp32-ga2-auto] (two ranks) and test_train_batch_is_bit_identical_with_cpu_offload (bf16, clip)",
    "tests/test_finetune_e2e.py::test_layer_major_trains_like_dram_offload_with_a_short_last_window":  # 34 s
        "test_hf_trainer.py::test_layer_major_trainer_equals_the_cpu_offload_trainer and test_layer_major.py",
    "tests/test_drop_in.py::test_optimizer_on_nvme_with_parameters_in_dram[param_cpu]": "[param_none]",  # 18 s
    "tests/test_step_pipeline.py::test_updates_riding_the_forward_are_deepspeeds[bf16-ga4-lr]":
        "[ws2-ga2-lr] (accumulation, a scheduler's learning rate)",
    "tests/test_step_pipeline.py::test_updates_riding_the_forward_are_deepspeeds[gpt2-ws2-defaults]":
        "[ws2-ga2-lr] and test_drop_in.py::test_fuzz_sample[gpt2_ckpt-ws2] (DeepSpeed's defaults, GPT-2)",
    "tests/test_step_pipeline.py::test_without_riding_every_update_runs_in_step[false]": "[auto] (the same path)",
    "tests/test_zero3_api.py::test_destroy_then_new_engine_loads_checkpoint[module_only]": "[full]",
    "tests/test_zero3_api.py::test_destroy_then_new_engine_loads_checkpoint[no_optimizer]": "[full]",
    "tests/test_zero3_api.py::test_gathered_parameters_edit_is_kept[1]": "[2]",
    "tests/test_zero3_api.py::test_tensor_fragment_set_two_ranks[local]": "[full]",
    "tests/test_drop_in.py::test_fuzz_sample[mlp-ws2]": "[mlp_bias-ws1] and the other 2-rank draws",
    "tests/test_drop_in.py::test_fuzz_sample[mlp_bias-ws2]": "[mlp_bias-ws1] and the other 2-rank draws",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tier ``unit`` for every test without another tier marker (before ``-m`` selects); ``slow`` for
    :data:`SLOW_VARIANTS`."""
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(pytest.mark.unit)
        if item.nodeid in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    is_unit = not any(item.get_closest_marker(t) for t in TIERS)
    _current["item"] = item if is_unit else None
    try:
        yield
    finally:
        _current["item"] = None


# ---------------------------------------------------------------- fixtures of the benchmark suites (tests/bench/)
@pytest.fixture
def timing(request) -> bool:
    """True when the benchmarks time (``--benchmark-enable``); under the project's default
    ``--benchmark-disable`` each case runs once, at a smaller size, as a test."""
    c = request.config
    return not (c.getoption("benchmark_disable", False) and not c.getoption("benchmark_enable", False))


@pytest.fixture
def runtime(tmp_path, request):
    """A budget-0 runtime on its own cache directory (closed and deleted afterwards); the directory is
    under ``AIDAPTIV_BENCH_DIR`` when set (a real cache drive), else pytest's tmp dir."""
    from aidaptiv_ds.integration.config import AidaptivConfig
    from aidaptiv_ds.integration.runtime import Runtime

    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    base = os.environ.get("AIDAPTIV_BENCH_DIR") or str(tmp_path)
    d = os.path.join(base, f"aidaptiv-{name}-{os.getpid()}")
    os.makedirs(d, exist_ok=True)
    rt = Runtime(AidaptivConfig(cache_paths=[d], dram_budget=0, run_name=name))
    yield rt
    rt.close()
