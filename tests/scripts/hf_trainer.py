"""An unmodified HF Trainer script: it never imports aidaptiv_ds (run it through ``python -m aidaptiv_ds.run``).

    python -m aidaptiv_ds.run tests/scripts/hf_trainer.py MODEL_DIR DS_CONFIG OUT_DIR [GA [EXAMPLES [layer_major]]]

No launcher variables are set here: ``aidaptiv_ds.run`` makes a lone ``python`` process a world of one, and
``accelerate launch`` sets its own. ``use_cpu`` on a host without CUDA is HF's own requirement for CPU training
(without it HF counts the launcher's ranks twice in the batch size), with DeepSpeed's CPU offload alike. With
``layer_major`` it uses ``aidaptiv_ds.finetune.hf_trainer.LayerMajorTrainer`` instead of ``Trainer`` (the
only change a script makes for layer-major accumulation).
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments


def main():
    model_dir, ds_config, out = sys.argv[1:4]
    ga = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    n = int(sys.argv[5]) if len(sys.argv) > 5 else 12
    trainer_class = Trainer
    if sys.argv[6:] == ["layer_major"]:
        from aidaptiv_ds.finetune.hf_trainer import LayerMajorTrainer as trainer_class
    args = TrainingArguments(output_dir=out, deepspeed=ds_config, per_device_train_batch_size=2, max_steps=3,
                             gradient_accumulation_steps=ga,
                             learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                             disable_tqdm=True, use_cpu=not torch.cuda.is_available())
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, model.config.vocab_size, (16,), generator=g)), "labels": ids}
            for _ in range(n)]
    trainer = trainer_class(model=model, args=args, train_dataset=data)
    trainer.train()
    opt = trainer.model_wrapped.optimizer
    p = next(trainer.model_wrapped.module.parameters())
    print("RESULT " + json.dumps({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                                  "param_swapper": type(p.nvme_swapper).__name__,
                                  "layer_major_steps": int(hasattr(trainer.model_wrapped, "aidaptiv_losses")),
                                  "optimizer_swapper": type(opt.optimizer_swapper).__name__}))


if __name__ == "__main__":
    main()
