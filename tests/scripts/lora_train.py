"""A PEFT LoRA fine-tuning script as users write it for DeepSpeed ZeRO-3 (``tests/test_lora.py``): the base model
frozen, LoRA adapters on the attention projections, activation checkpointing, DeepSpeed's own defaults for every
knob the config leaves out (``gradient_clipping``, ``sub_group_size``, the persistence threshold).

usage: lora_train.py MODEL_DIR CONFIG.json OUT_DIR straight|resume|from:CKPT_DIR

``straight`` trains 6 optimizer steps; ``resume`` trains 3, saves a checkpoint, trains 3 more (``continued``),
destroys the engine, builds a new model and engine, loads the checkpoint and trains the last 3 again; ``from:CKPT_DIR`` loads CKPT_DIR (saved at step 3,
by either backend) and trains the last 3. Prints ``RESULT {json}``: the loss of every micro-batch,
an eval loss, the sum of every trainable tensor (gathered) and of one frozen base tensor.
"""
import json
import os
import sys

import deepspeed
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import aidaptiv_ds  # noqa: F401  (activates the backend where the config asks for it)

MODEL, CONFIG, OUT, MODE = sys.argv[1:5]
STEPS = 6
for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
    os.environ.setdefault(k, v)
with open(CONFIG) as f:
    cfg = json.load(f)
ga = int(cfg.get("gradient_accumulation_steps", 1))


def build():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             lora_dropout=0.0))
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=cfg)
    return engine


def batch(i: int) -> torch.Tensor:
    return torch.randint(0, 512, (int(cfg["train_micro_batch_size_per_gpu"]), 32),
                         generator=torch.Generator().manual_seed(1000 + i))


def train(engine, first: int, last: int, losses: list) -> None:
    for i in range(first * ga, last * ga):
        ids = batch(i)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())


losses: list = []
continued: list = []  # resume: the losses of the engine that saved, trained on after the save
engine = build()
if MODE == "straight":
    train(engine, 0, STEPS, losses)
elif MODE.startswith("from:"):
    engine.load_checkpoint(MODE[5:])
    train(engine, STEPS // 2, STEPS, losses)
else:
    train(engine, 0, STEPS // 2, losses)
    engine.save_checkpoint(os.path.join(OUT, "ckpt"))
    train(engine, STEPS // 2, STEPS, continued)  # the same engine trains on after its save
    engine.destroy()
    engine = build()
    engine.load_checkpoint(os.path.join(OUT, "ckpt"))
    train(engine, STEPS // 2, STEPS, losses)
with torch.no_grad():
    ids = batch(10_000)
    eval_loss = engine(input_ids=ids, labels=ids).loss.item()
sums = {}
for name, p in engine.module.named_parameters():
    if p.requires_grad or name.endswith("layers.0.self_attn.q_proj.base_layer.weight"):
        with deepspeed.zero.GatheredParameters([p]):
            sums[name] = p.detach().double().sum().item()
swapper = getattr(engine.optimizer, "optimizer_swapper", None)
print("RESULT " + json.dumps({"losses": losses, "continued": continued, "eval": eval_loss, "sums": sums,
                              "optimizer_swapper": type(swapper).__name__}))
engine.destroy()
