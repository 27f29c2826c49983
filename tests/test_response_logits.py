"""Logits at the response positions only (issue 34; [Note: logits at the response positions only] in
``finetune/loop.py``): the training loss and the eval loss over the same tokens as the full-logits path, the
same gradients to rounding, and a logits tensor of the response tokens only."""
from __future__ import annotations

import pytest
import torch

from aidaptiv_ds.finetune.evaluate import evaluate, hf_forward, response_logits_supported
from aidaptiv_ds.finetune.loop import training_loss
from aidaptiv_ds.finetune.template import IGNORE_INDEX, Example, collate

transformers = pytest.importorskip("transformers")


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).float()


def _examples():
    g = torch.Generator().manual_seed(1)
    out = []
    for n, prompt in ((20, 8), (13, 5), (17, 16)):
        ids = torch.randint(0, 97, (n,), generator=g).tolist()
        out.append(Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return out


def test_the_models_of_transformers_take_a_response_mask():
    assert response_logits_supported(_model())
    assert not response_logits_supported(torch.nn.Linear(2, 2))


def test_training_loss_and_gradients_match_the_full_logits():
    batch = collate(_examples(), pad_id=0)
    losses, grads = [], []
    for kept in (False, True):
        m = _model()
        loss = training_loss(m, batch, kept)
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_only_the_response_positions_get_logits():
    batch = collate(_examples(), pad_id=0)
    fwd = hf_forward(_model(), response_logits_only=True)
    logits, target = fwd(batch["input_ids"], batch["attention_mask"], batch["labels"])
    n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert logits.shape == (n, 97) and target.shape == (n,)
    assert n < batch["input_ids"].numel() // 2  # prompts and padding got none


def test_eval_loss_matches_the_full_logits():
    m = _model().eval()
    full = evaluate(hf_forward(m), _examples(), 2, 0)
    kept = evaluate(hf_forward(m, response_logits_only=True), _examples(), 2, 0)
    assert full["eval_tokens"] == kept["eval_tokens"]
    assert kept["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-6)


def test_logits_positions_counts_what_the_lm_head_computes():
    from aidaptiv_ds.finetune.loop import logits_positions

    batch = collate(_examples(), pad_id=0)
    kept = logits_positions(batch, True)
    fwd = hf_forward(_model(), response_logits_only=True)
    logits, _ = fwd(batch["input_ids"], batch["attention_mask"], batch["labels"])
    assert kept == logits.shape[0]
    assert logits_positions(batch, False) == batch["input_ids"].numel() == 3 * 20


def test_planned_activations_follow_the_runs_checkpointing_and_logits():
    """The summary's planned activations and logits (finetune/memory.py) count the run's settings: SmolLM2's
    shape, fp32, seq 512, batch 4: checkpointing and 318 logits positions (the Dolly sample's mean) plan less than
    every layer's activations and 2048 positions, and the logits part is tokens x vocab x (4 + 12) bytes."""
    from aidaptiv_ds.finetune.memory import planned_parts

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                   tie_word_embeddings=True).to_dict()
    full = planned_parts(cfg, {}, 134_515_008, 512, 4, 1, 4, True)["activations_logits_bytes"]
    lean = planned_parts(cfg, {}, 134_515_008, 512, 4, 1, 4, True, checkpointing=True,
                         logits_tokens=318)["activations_logits_bytes"]
    fewer = planned_parts(cfg, {}, 134_515_008, 512, 4, 1, 4, True,
                          logits_tokens=2048 - 1000)["activations_logits_bytes"]
    assert full - fewer == 1000 * 49152 * (4 + 12)
    assert lean < fewer < full
    assert planned_parts(cfg, {}, 134_515_008, 512, 4, 1, 4, False)["activations_logits_bytes"] == 0


def test_the_gathered_parameters_are_counted_once_in_the_memory_parts():
    """finetune/memory.py: on one rank with the parameters on the cache tier the gathered parameters are our swap
    buffers (planner/auto.py, [Note: the gathered parameters' partitions]), already in "ours" (the DRAM tier or the
    buffer pool): DeepSpeed's planned part is then its reduce bucket alone; over two ranks its gathered copies are
    its own."""
    from aidaptiv_ds.finetune.memory import planned_parts

    nvme = {"zero_optimization": {"offload_param": {"device": "nvme"}, "stage3_max_live_parameters": 1000,
                                  "reduce_bucket_size": 500}}
    cpu = {"zero_optimization": {"offload_param": {"device": "cpu"}, "stage3_max_live_parameters": 1000,
                                 "reduce_bucket_size": 500}}
    # no model config: a module may be the whole model, so DeepSpeed may hold all of it gathered (planner/auto.py,
    # [Note: what bounds the gathered parameters]; the reuse distance left out is DeepSpeed's 1e9 anyway)
    assert planned_parts(None, nvme, 10_000, 8, 1, 1, 4, True)["deepspeed_bytes"] == 500 * 4
    assert planned_parts(None, cpu, 10_000, 8, 1, 1, 4, True)["deepspeed_bytes"] == (10_000 + 500) * 4
    two = planned_parts(None, nvme, 10_000, 8, 1, 2, 4, True)["deepspeed_bytes"]
    assert two == 10_000 * 4 + 3 * 500 * 4  # the gathered copies and the reduce-scatter's three buckets


def test_the_memory_parts_count_a_built_models_own_modules():
    """finetune/memory.py with the built model (``module=engine.module``): a model family the planner does not
    know is counted from its module tree as the runtime counts it (the largest module twice, the persistent
    parameters), not as one module the size of the model."""
    from aidaptiv_ds.finetune.memory import planned_parts

    model = torch.nn.Sequential(*[torch.nn.Linear(100, 100) for _ in range(10)])  # 10 x 10,100 elements
    knobs = {"zero_optimization": {"offload_param": {"device": "cpu"}, "stage3_max_live_parameters": 1000,
                                   "stage3_max_reuse_distance": 1000, "reduce_bucket_size": 500}}
    n = sum(p.numel() for p in model.parameters())
    assert planned_parts(None, knobs, n, 8, 1, 1, 4, True)["deepspeed_bytes"] == (n + 500) * 4
    assert planned_parts(None, knobs, n, 8, 1, 1, 4, True, module=model)["deepspeed_bytes"] == \
        (1000 + 2 * 10_100 + 500) * 4
    model[3].bias.ds_persist = True  # as mark_persistent_parameters flags a tensor under the threshold
    assert planned_parts(None, knobs, n, 8, 1, 1, 4, True, module=model)["deepspeed_bytes"] == \
        (1000 + 2 * 10_100 + 100 + 500) * 4
    model[5].weight.requires_grad_(False)  # a frozen layer: recomputed, it stays gathered (planner/auto.py)
    assert planned_parts(None, knobs, n, 8, 1, 1, 4, True, module=model)["deepspeed_bytes"] == \
        (1000 + 2 * 10_100 + 100 + 10_000 + 500) * 4
