"""The optimizer's param groups a checkpoint keeps and a load restores (``integration/checkpointing.py``,
``param_group_values`` / ``restore_param_groups``), through the JSON of the checkpoint's index, as DeepSpeed's
CPU-offload load restores them with ``optimizer.load_state_dict``."""
from __future__ import annotations

import json

import pytest
import torch

from aidaptiv_ds.integration.checkpointing import param_group_values, restore_param_groups


def _adamw(lr, **kw) -> torch.optim.AdamW:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], lr=lr, **kw)


def test_every_hyperparameter_round_trips_through_the_index():
    saved = _adamw(torch.tensor(3e-4), betas=(0.8, 0.95), weight_decay=0.1, foreach=False)
    saved.param_groups[0]["custom_note"] = "warm-up"
    on_disk = json.loads(json.dumps([param_group_values(g) for g in saved.param_groups]))
    assert on_disk[0]["lr"] == pytest.approx(3e-4) and on_disk[0]["foreach"] is False
    assert "params" not in on_disk[0] and on_disk[0]["fused"] is None  # None settings are kept too
    fresh = _adamw(torch.tensor(1.0), foreach=None)
    lr_tensor = fresh.param_groups[0]["lr"]
    restore_param_groups(fresh.param_groups, on_disk, "tag")
    g, want = fresh.param_groups[0], saved.param_groups[0]
    assert g["lr"] is lr_tensor and g["lr"].item() == want["lr"].item()  # written into the group's own tensor
    assert g["betas"] == (0.8, 0.95) and isinstance(g["betas"], tuple)
    for k in want:
        if k not in ("params", "lr"):
            assert g[k] == want[k], k
    # a float lr, and a group that holds a float where the checkpoint kept a number
    floats = _adamw(1.0)
    restore_param_groups(floats.param_groups, on_disk, "tag")
    assert floats.param_groups[0]["lr"] == pytest.approx(3e-4) and not isinstance(floats.param_groups[0]["lr"],
                                                                                 torch.Tensor)


def test_a_checkpoint_of_another_optimizer_setup_is_refused_by_name():
    two = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(2))]},
                             {"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": 0.0}])
    with pytest.raises(ValueError, match="has 1 optimizer param group.*load_optimizer_states=False"):
        restore_param_groups(two.param_groups, [param_group_values(_adamw(1e-3).param_groups[0])], "ckpt/tag")
    restore_param_groups(two.param_groups, [], "ckpt/tag")  # an older checkpoint without groups: as it was
    assert two.param_groups[1]["weight_decay"] == 0.0
