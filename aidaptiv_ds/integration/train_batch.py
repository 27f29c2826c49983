"""``engine.train_batch(data_iter)``: one optimizer step over the accumulation window, layer-major, on
DeepSpeed's engine (issue 38). The schedule is ``layer_major.py``; here is what DeepSpeed's engine does
around its pieces (:class:`EnginePieces`) and the step's bookkeeping.

[Note: one DeepSpeed backward per step]
DeepSpeed's engine knows one backward per micro-batch: ``engine.backward`` runs ``_backward_prologue``
(boundary flag, ZeRO's backward state, our phase), ``loss.backward()`` and ``_backward_epilogue`` (the last
reduce bucket, the norms at the boundary, the end of the window's gradients). A layer-major step runs
every micro-batch's backward as pieces inside one such envelope, with ``_running_engine_backward`` set
as ``engine.backward`` sets it (DeepSpeed's post-backward hook then leaves the epilogue to us). It opens at
the first micro-batch's loss, when every block's forward is done: each micro-batch's piece after the trunk
runs as soon as its loss is there, so its logits are freed then, not held for k micro-batches.

* before each piece DeepSpeed's boundary flag says whether it is the last micro-batch's, and the gradient
  store counts arrivals "in the last micro-step" only then (``GradientStore.count_arrivals_now``);
* after each piece the reduce buckets are flushed (``_aidaptiv_flush_reduce_buckets``): a bucket may hold
  a parameter's gradient once, and each piece gives each of its parameters one;
* the model's root hook would reset DeepSpeed's parameter coordinator at each micro-batch's forward
  (``reset_step``); it is reset once per step instead, so its trace is the whole layer-major step;
* then ``engine.step()`` k times: the micro-step counter, the samples and the scheduler advance as they do
  micro-batch by micro-batch, and the k-th is the boundary that finishes the optimizer step (set with
  ``set_gradient_accumulation_boundary`` for each, then the caller's own override, if any, put back).
"""
from __future__ import annotations

import logging
import types

import torch

from .config import AidaptivConfigError
from .layer_major import LayerMajorBackward, layer_major_forward, micro_batches
from .trunk import FIX, active_dropout, find_trunk, tied_outside

log = logging.getLogger(__name__)

#: what a held block's parameters carry in DeepSpeed's ``ds_active_sub_modules`` (module ids are >= 0)
_HOLD = -1


def _zero_params(block: torch.nn.Module) -> list:
    return [p for p in block.parameters() if hasattr(p, "ds_id")]


class EnginePieces:
    """:class:`layer_major.Pieces` on DeepSpeed's ZeRO-3 engine with the ``"aidaptiv"`` section."""

    def __init__(self, engine, scale_wrt_gas: bool = True) -> None:
        self.engine = engine
        self.opt = engine.optimizer
        self.grads = engine.optimizer._aidaptiv.grads
        self.gas = engine.gradient_accumulation_steps()
        self.scale_wrt_gas = scale_wrt_gas
        self.boundary = getattr(engine, "_aidaptiv_boundary", None)
        if self.boundary is None:
            from .activations import BoundaryStore
            self.boundary = engine._aidaptiv_boundary = BoundaryStore(self.grads.rt, self.grads.engine_id)
        self.withheld: list = []

    # ------------------------------------------------------------ [Note: one fetch per block]
    def hold(self, block: torch.nn.Module) -> None:
        """DeepSpeed gathers what is not available, and does not release a parameter while its
        ``ds_active_sub_modules`` is not empty (``__release_param``), so its module hooks leave them gathered."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        params = _zero_params(block)
        need = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if need:
            need[0].all_gather(param_list=need)
        for p in params:
            p.ds_active_sub_modules.add(_HOLD)

    def unhold(self, block: torch.nn.Module, only_held: bool = False) -> None:
        """Release what :meth:`hold` kept (persistent parameters stay, as DeepSpeed keeps them); ``only_held``:
        nothing when the block is not held."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        params = _zero_params(block)
        if only_held and not any(_HOLD in p.ds_active_sub_modules for p in params):
            return
        for p in params:
            p.ds_active_sub_modules.discard(_HOLD)
        done = [p for p in params if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_active_sub_modules
                and not p.ds_persist]
        if done:
            done[0].partition(param_list=done)

    # ------------------------------------------------------------ [Note: one DeepSpeed backward per step]
    def begin(self, j: int, boundary: bool) -> None:
        self.opt.set_gradient_accumulation_boundary(boundary)
        self.grads.count_arrivals_now(boundary)

    def end(self) -> None:
        self.opt._aidaptiv_flush_reduce_buckets()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        # engine.backward's scaling, in its order (scale_wrt_gas: its argument of the same name)
        return self.opt.scale_if_loss(loss / self.gas if self.scale_wrt_gas else loss)

    def withhold(self, params: list) -> None:
        self.withheld = list(params)
        for p in self.withheld:
            p.ds_grad_is_ready = False  # DeepSpeed's reduce hook leaves the gradient in .grad

    def release(self, param) -> None:
        param.ds_grad_is_ready = True
        self.opt.reduce_ready_partitions_and_remove_grads(param)
        param.ds_grad_is_ready = False

    # ------------------------------------------------------------ boundary activations (activations.py)
    def keep(self, key: tuple, x: torch.Tensor):
        return self.boundary.keep(key, x)

    def take(self, token) -> torch.Tensor:
        return self.boundary.take(token)

    def prefetch(self, tokens: list) -> None:
        self.boundary.prefetch(tokens)

    def restore(self) -> None:
        for p in self.withheld:
            p.ds_grad_is_ready = True
        self.withheld = []
        self.grads.count_arrivals_now(True)


def _repeat(loader):
    """The engine's training loader, epoch after epoch (as ``PipelineEngine`` wraps it in a ``RepeatingLoader``)."""
    while True:
        yield from loader


def _check_engine(engine) -> None:
    opt = getattr(engine, "optimizer", None)
    if getattr(getattr(opt, "_aidaptiv", None), "grads", None) is None:
        raise AidaptivConfigError(
            "aidaptiv_ds: engine.train_batch (layer-major) runs on ZeRO stage 3 with the \"aidaptiv\" section "
            "enabled and an optimizer. " + FIX)
    if engine.torch_autocast_enabled() or torch.is_autocast_enabled("cpu") or (
            torch.cuda.is_available() and torch.is_autocast_enabled("cuda")):
        raise AidaptivConfigError(
            "aidaptiv_ds: engine.train_batch (layer-major) does not run under an autocast region (DeepSpeed's "
            "\"torch_autocast\" or the caller's torch.autocast): its backward recomputes each block, and "
            "the recompute is not cast as the forward was, so its bits would not be DeepSpeed's. Fix: train in the "
            "model's dtype (DeepSpeed's bf16/fp16 sections) or micro-batch by micro-batch.")
    if not engine.managed_gradient_accumulation():
        raise AidaptivConfigError(
            "aidaptiv_ds: engine.train_batch (layer-major) owns the accumulation window; "
            "\"managed_gradient_accumulation\": false leaves it to the caller. Fix: leave it at its default (true).")
    from .gradients import GradState
    pl = opt._aidaptiv.pipeline  # the last step's updates riding this forward keep their gradients until they run
    riding = set(pl.deferred) if pl is not None else set()
    if any(g.state is not GradState.EMPTY and g.index not in riding for g in opt._aidaptiv.grads.groups):
        raise AidaptivConfigError(
            "aidaptiv_ds: engine.train_batch (layer-major) starts an accumulation window, but gradients of the current "
            "one are waiting (engine.backward ran without the optimizer step of its boundary). Fix: finish that "
            "window first (engine.step() at its boundary).")


def train_batch(engine, data_iter=None, scale_wrt_gas: bool = True) -> torch.Tensor:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches of ``data_iter``, layer-major.

    DeepSpeed's convention for a whole batch (its ``PipelineEngine.train_batch``): the engine pulls the
    micro-batches (from ``data_iter``, else from the loader of ``deepspeed.initialize(training_data=...)``,
    epoch after epoch), runs forward, backward
    and the optimizer step, and returns the mean loss; the model is put in training mode first. Each
    micro-batch is a dict (``model(**batch)``), a tuple or list (``model(*batch)``) or one tensor; the model
    returns its loss or an output with ``.loss``. Bit for bit the result of ``loss = engine(batch);
    engine.backward(loss); engine.step()`` per micro-batch ([Note: exact against micro-batch-major] in
    ``layer_major.py``), except with dropout active: its masks are drawn in another order ([Note: dropout in
    the recompute]; logged once). ``scale_wrt_gas``: as ``engine.backward``'s argument (False: each micro-batch's loss
    is not divided by ``gradient_accumulation_steps``; HF ``Trainer`` normalises by the window's token count).

    Returns:
        The mean of the micro-batches' losses (a detached fp32 scalar); ``engine.aidaptiv_losses`` holds each
        micro-batch's loss (detached tensors, in order).

    Raises:
        AidaptivConfigError: the engine, the model (``trunk.find_trunk``) or ``data_iter`` cannot do this.
    """
    _check_engine(engine)
    engine.module.train()
    opt = engine.optimizer
    trunk = getattr(engine, "_aidaptiv_trunk", None)
    if trunk is None:
        trunk = find_trunk(engine.module)
        engine._aidaptiv_trunk = trunk
        engine._aidaptiv_tied = tied_outside(engine.module, trunk)
        drop = active_dropout(engine.module)
        if drop and engine.global_rank == 0:
            log.info("aidaptiv_ds: engine.train_batch with dropout active (%s%s): each block's recompute replays the "
                     "masks its forward drew, so the gradients are exact for those masks; they are drawn block by "
                     "block, in another order than micro-batch by micro-batch, so the run is not bit-identical with "
                     "DeepSpeed's (layer_major.py, [Note: dropout in the recompute]). Set the model's dropout to 0 "
                     "for DeepSpeed's bits.", ", ".join(drop[:3]), ", ..." if len(drop) > 3 else "")
    k = engine.gradient_accumulation_steps()
    if data_iter is None:
        data_iter = getattr(engine, "_aidaptiv_data_iter", None)
        if data_iter is None:
            loader = getattr(engine, "training_dataloader", None)
            if loader is None:
                raise AidaptivConfigError(
                    "aidaptiv_ds: engine.train_batch() without data_iter needs deepspeed.initialize(training_data=...). "
                    "Fix: pass an iterator of micro-batches, engine.train_batch(iter(loader)).")
            data_iter = engine._aidaptiv_data_iter = _repeat(loader)
    batches = micro_batches(data_iter, k)
    pieces = EnginePieces(engine, scale_wrt_gas)
    coordinator = opt.parameter_offload.get_param_coordinator()
    opt.clear_backward_seen_flag()
    coordinator.reset_step()  # one trace per optimizer step: the k forwards and the pieces together
    opened = []

    def open_backward() -> None:  # [Note: one DeepSpeed backward per step], at the first micro-batch's loss
        with engine._running_engine_backward_lock:
            engine._running_engine_backward_count += 1
            engine._running_engine_backward = True
        opened.append(True)
        engine._backward_prologue()

    backward = LayerMajorBackward(trunk, k, engine._aidaptiv_tied, pieces, start=open_backward)
    coordinator.reset_step = lambda: None  # the model's root hook calls it at each micro-batch's forward
    try:
        recs = layer_major_forward(engine.module, trunk, batches, pieces, on_loss=backward.tail)
        del coordinator.reset_step
        backward.finish(recs)
        pieces.begin(k - 1, True)
        engine._backward_epilogue()
    finally:
        coordinator.__dict__.pop("reset_step", None)
        for block in trunk.blocks:  # a step that failed part way leaves no block held
            pieces.unhold(block, only_held=True)
        pieces.restore()
        pieces.boundary.discard()  # nothing, unless the step failed part way
        if opened:
            with engine._running_engine_backward_lock:
                engine._running_engine_backward_count -= 1
                engine._running_engine_backward = engine._running_engine_backward_count > 0
    prev = engine._is_gradient_accumulation_boundary  # a caller's override (set_gradient_accumulation_boundary)
    try:
        for j in range(k):
            engine.set_gradient_accumulation_boundary(j == k - 1)
            engine.step()
    finally:
        engine._is_gradient_accumulation_boundary = prev
    engine.aidaptiv_losses = [r.loss for r in recs]  # detached by the backward
    return torch.stack([x.float() for x in engine.aidaptiv_losses]).mean()


def attach(engine) -> None:
    """Give an engine with the ``"aidaptiv"`` section ``engine.train_batch(data_iter)`` (:func:`train_batch`),
    unless its class has one (DeepSpeed's ``PipelineEngine``)."""
    if not hasattr(engine, "train_batch"):
        engine.train_batch = types.MethodType(train_batch, engine)
