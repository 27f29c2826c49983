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


def test_a_checkpoint_of_partitions_over_a_smaller_group_is_refused_by_name(monkeypatch):
    """Saved ranges are read by ``rank * partition_numel`` over the world: an engine partitioned over a smaller
    group (zero.Init's data_parallel_group, sequence parallelism) would save and read other ranks' slices."""
    from aidaptiv_ds.errors import AidaptivConfigError
    from aidaptiv_ds.integration import checkpointing

    world, half = object(), object()
    fake = types.SimpleNamespace(get_world_size=lambda group=None: 2 if group is half else 4,
                                 get_rank=lambda group=None: 3)
    monkeypatch.setattr(checkpointing, "_dist", lambda: fake)
    m = _model()
    for p in m.parameters():
        p.ds_process_group, p.ds_tensor = world, torch.zeros(1)
    assert checkpointing.partition_rank(m, "save_checkpoint") == 3
    m[1].bias.ds_process_group = half
    with pytest.raises(AidaptivConfigError, match=r"save_checkpoint: parameter '1.bias' is partitioned over a "
                                                  r"group of 2 ranks, not over all 4.*Fix:"):
        checkpointing.partition_rank(m, "save_checkpoint")
