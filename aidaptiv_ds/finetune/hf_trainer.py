"""HF ``Trainer`` with layer-major gradient accumulation: :class:`LayerMajorTrainer` hands each accumulation
window's micro-batches to ``engine.train_batch`` (aidaptiv_ds's layer-major step, issue 38).

Use it in place of ``transformers.Trainer`` (same arguments, same ``--deepspeed`` config with the ``"aidaptiv"``
section)::

    from aidaptiv_ds.finetune.hf_trainer import LayerMajorTrainer
    trainer = LayerMajorTrainer(model=model, args=args, train_dataset=data)
    trainer.train()

[Note: the Trainer's window]
Trainer (transformers 5) fetches a whole accumulation window before its first micro-batch (it counts the
window's label tokens, ``num_items_in_batch``) and calls ``training_step`` once per micro-batch. Here the
first k-1 calls keep the micro-batch's model inputs (as ``compute_loss`` would pass them, with
``num_items_in_batch`` where the model takes loss kwargs) and return a zero loss; the k-th runs the window
with ``engine.train_batch`` and returns the window's loss as Trainer would have summed it (in its order, fp32
tensor adds), so a ``logging_steps=1`` log equals the micro-batch-major run's bit for bit (with a longer
logging interval the last bits of the logged mean can differ: Trainer adds the zeros and the window's sum in
another order). The loss scaling is the one ``training_step`` applies: divided by the window's micro-batches
unless the loss is already normalised by ``num_items_in_batch`` (then ``scale_wrt_gas=False``, as Trainer
passes it to DeepSpeed). A window shorter than ``gradient_accumulation_steps`` (an epoch's last) runs
micro-batch by micro-batch through ``Trainer.training_step``.
"""
from __future__ import annotations

import torch
from transformers import Trainer

from ..errors import AidaptivConfigError


class LayerMajorTrainer(Trainer):
    """``transformers.Trainer`` whose accumulation windows run layer-major ([Note: the Trainer's window]).

    Raises:
        AidaptivConfigError: (at the first training step) the model is not a DeepSpeed engine with the
            ``"aidaptiv"`` section (it has no ``train_batch``), or ``compute_loss`` is overridden (the window's
            losses are the model's own).
    """

    def training_step(self, model, inputs, num_items_in_batch=None):
        engine = self.model_wrapped
        train_batch = getattr(engine, "train_batch", None)
        if train_batch is None:
            raise AidaptivConfigError(
                "aidaptiv_ds: LayerMajorTrainer needs DeepSpeed ZeRO-3 with the \"aidaptiv\" section enabled (its "
                "engine has train_batch); this Trainer's model is a " + type(engine).__name__ + ". Fix: pass "
                "TrainingArguments(deepspeed=CONFIG) with the section, or use transformers.Trainer.")
        if type(self).compute_loss is not Trainer.compute_loss:
            raise AidaptivConfigError(
                "aidaptiv_ds: LayerMajorTrainer runs the model's own loss; this Trainer overrides compute_loss. "
                "Fix: return the loss from the model's forward (or use transformers.Trainer).")
        window = self.__dict__.setdefault("_aidaptiv_window", [])
        k = engine.gradient_accumulation_steps()
        if not window and self.current_gradient_accumulation_steps != k:
            return super().training_step(model, inputs, num_items_in_batch)  # a short last window
        model.train()
        kwargs = dict(self._prepare_inputs(inputs))
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            kwargs["num_items_in_batch"] = num_items_in_batch  # as compute_loss passes it
        window.append(kwargs)
        if len(window) < k:
            return torch.zeros((), device=self.args.device)
        if self.loss_is_scaled_for_ga is not None:
            scaled = self.loss_is_scaled_for_ga
        else:  # Trainer.training_step's rule
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        try:
            train_batch(iter(window), scale_wrt_gas=not scaled)
        finally:
            window.clear()
        total = None
        for loss in engine.aidaptiv_losses:  # what Trainer sums, in its order
            step = loss if scaled else loss / self.current_gradient_accumulation_steps
            total = step if total is None else total + step
        return total
