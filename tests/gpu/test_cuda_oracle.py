"""The oracle on a GPU: aidaptiv_ds through the cache path is bit-identical to DeepSpeed's CPU offload
with the model, the engine and the batches on CUDA (one rank, ZeRO-3).

A small tied Llama (``train_oracle.py --model llama``), bf16 and fp32, 6 optimizer steps of gradient
accumulation 2, gradient clipping on (1.0, which the gradient norms of this model exceed, so clipping
acts), DRAM budget 0 and half the training state. CUDA runs repeat bit for bit only with deterministic
kernels: every run uses ``--deterministic --attn eager``, and the first test checks that DeepSpeed's
own run repeats, so a difference in the others is aidaptiv_ds's. Skipped without CUDA.
"""
from __future__ import annotations

import pytest
from _cuda import GPU
from _oracle import cuda_oracle_args as oracle_args
from _oracle import differences, half_state_budget, oracle, run

pytestmark = [*GPU, pytest.mark.subprocess]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_deepspeed_cpu_offload_on_cuda_repeats_bit_for_bit(dtype, tmp_path_factory):
    ref = oracle(oracle_args(dtype), str(tmp_path_factory.getbasetemp()))
    again = run("cpu", oracle_args(dtype), str(tmp_path_factory.mktemp(f"again-{dtype}")))
    assert ref["device"].startswith("cuda") and ref["accelerator"] == "cuda", ref["device"]
    assert max(n for n in ref["norms"]) > 1.0, "clipping never acted (every gradient norm <= 1.0)"
    assert differences(ref, again) == [], f"DeepSpeed's own run does not repeat on this GPU " \
        f"(nondeterministic ops: {ref['nondeterministic_ops']})"


@pytest.mark.parametrize("budget", ["0", "half"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_bit_identical_with_cpu_offload_on_cuda(dtype, budget, tmp_path_factory):
    ref = oracle(oracle_args(dtype), str(tmp_path_factory.getbasetemp()))
    b = str(half_state_budget(dtype)) if budget == "half" else budget
    got = run("aidaptiv", oracle_args(dtype) + ["--budget", b], str(tmp_path_factory.mktemp(f"{dtype}-{budget}")))
    assert got["device"].startswith("cuda"), got["device"]
    assert got["swapper"] == "AidaptivParamSwapper" and got["optimizer_swapper"] == "AidaptivOptimizerSwapper"
    assert got["norms"] == ref["norms"]
    assert differences(ref, got) == []
