"""The checks ``load_checkpoint`` makes before a load changes anything (``integration/load_weights.py``), against
PyTorch's own ``load_state_dict`` messages; the loads themselves are compared with DeepSpeed's in
``tests/test_zero3_api.py`` (scenario ``warm_load``)."""
from __future__ import annotations

import types

import pytest
import torch

from aidaptiv_ds.integration.load_weights import _partition_of, check_module_keys, check_shapes


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    m.register_buffer("kept", torch.zeros(2))
    m.register_buffer("scratch", torch.zeros(2), persistent=False)
    return m


def test_a_strict_load_raises_pytorchs_error_for_the_same_keys():
    m = _model()
    saved = [k for k in m.state_dict() if k != "0.bias"] + ["extra.weight"]
    with pytest.raises(RuntimeError) as ours:
        check_module_keys(m, saved, strict=True)
    sd = {k: v for k, v in m.state_dict().items() if k != "0.bias"} | {"extra.weight": torch.zeros(1)}
    with pytest.raises(RuntimeError) as torchs:
        m.load_state_dict(sd, strict=True)
    assert str(ours.value) == str(torchs.value)
    check_module_keys(m, saved, strict=False)  # non-strict: nothing raised
    check_module_keys(m, list(m.state_dict()), strict=True)  # a non-persistent buffer is no key


def test_a_parameter_of_another_shape_is_refused_with_pytorchs_message():
    m = _model()
    names = {id(p): n for n, p in m.named_parameters()}
    info = types.SimpleNamespace
    reader = types.SimpleNamespace(params={"0.weight": info(shape=(5, 4)), "0.bias": info(shape=(3,))})
    with pytest.raises(RuntimeError) as ours:
        check_shapes(m, names, reader)
    with pytest.raises(RuntimeError) as torchs:
        m.load_state_dict({"0.weight": torch.zeros(5, 4)}, strict=False)
    assert str(ours.value) == str(torchs.value)
    check_shapes(m, names, types.SimpleNamespace(params={"0.bias": info(shape=(3,))}))


def test_a_partition_is_the_ranks_padded_slice():
    full = torch.arange(10.0).reshape(2, 5)
    assert _partition_of(full, 0, 4).tolist() == [0, 1, 2, 3]
    assert _partition_of(full, 2, 4).tolist() == [8, 9, 0, 0]  # DeepSpeed pads the last partition with zeros
