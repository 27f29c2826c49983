"""The layer-major schedule: the k micro-batches of one optimizer step, block by block (issue 38;
GreedySnake's "vertical" schedule, arXiv 2512.17570). No DeepSpeed here: what the engine does around each
piece is a :class:`Pieces` (``train_batch.py`` for DeepSpeed's engine; the tests' plain-PyTorch one).

[Note: layer-major order]
DeepSpeed accumulates micro-batch by micro-batch: each micro-batch runs the whole forward and the whole
backward, so every parameter is fetched twice per micro-batch (2k times per optimizer step). Here the
k micro-batches run the model's trunk (the ``ModuleList`` of decoder layers, :func:`find_trunk`) one
block at a time:

* **forward**: every micro-batch runs the model's own ``forward`` as a greenlet of its own on the calling
  thread ([Note: one OS thread]); each runs to a block's entry, or past the last block, and hands over to
  the next, so the order is: the code before the trunk (embeddings, masks, rotary tables)
  for micro-batches 0..k-1, block 0 for 0..k-1, block 1 for 0..k-1, ..., the code after the trunk
  (final norm, head, loss) for 0..k-1. The model's code is unchanged; DeepSpeed's module hooks run as
  they do in ``engine(batch)``. Each block's input of each micro-batch is kept (the boundary
  activations: activation checkpointing at the block boundary); a block's own activations are freed
  when it returns.
* **backward**: in pieces: the code after the trunk for 0..k-1 (from the loss,
  scaled by ``1/gradient_accumulation_steps`` as ``engine.backward`` scales it, to the trunk's output),
  then each block from the last to the first, for 0..k-1, recomputing the block's forward from its kept
  input and running its backward with the gradient the block above handed down; then the code before
  the trunk for 0..k-1. On DeepSpeed's engine all pieces run inside one backward (``_backward_prologue``
  .. ``_backward_epilogue``), with the reduce buckets flushed after each piece (``train_batch.py``).

[Note: exact against micro-batch-major]
A parameter's gradient partition receives the same k gradients, in the same order (micro-batch 0
first), as micro-batch-major accumulation, and each is bit-identical: a block's recomputed forward is
the forward's arithmetic again (CPU kernels are deterministic; the forward and the recompute both run
with gradients enabled; with dropout see [Note: dropout in the recompute]), and its backward is the
backward autograd would have run. The gradient store
copies the first and adds the rest in the accumulation dtype (``grad_path.partition_grads``). Two
things need care:

* the *accumulation boundary*: DeepSpeed's boundary is the last micro-step; here each piece of
  micro-batch k-1 is the boundary for the parameters it reaches, so DeepSpeed's boundary flag is set
  per piece, and the gradient store counts "arrived in the last micro-step" over the boundary pieces
  only (``GradientStore.count_arrivals_now``). A sub-group whose gradient is final is stepped as soon
  as its last block is done (inside backward, as micro-batch-major does at its boundary).
* a parameter used both before and after the trunk (tied input and output embeddings): autograd sums
  its two gradients of one micro-batch before DeepSpeed's hook sees it. Here they come from two pieces,
  so the first (after the trunk) is held back (DeepSpeed's ``ds_grad_is_ready``) and put back as the
  parameter's ``.grad`` before the second, where autograd adds the second to it: the same sum.

A parameter shared between blocks, or between the trunk and the rest, would receive several
gradients per micro-batch in separate pieces and cannot keep DeepSpeed's sums: such a model is refused
(``trunk.find_trunk``).

[Note: one fetch per block]
Each block's parameters are gathered once for its k micro-batches in forward and once for its k pieces in
backward (``Pieces.hold``), so a parameter is read at most twice per optimizer step instead of 2k times,
and a block's gradient is final when its k-th piece is done: nothing is written between micro-batches.

[Note: one way into the trunk]
The backward runs each block from the gradient of its output that the block above handed down, and the code
before the trunk from block 0's input gradient. That is the whole gradient only if the loss reaches the
trunk through the last block's output alone. A loss that also uses what a block computed inside (an MoE
router's logits for its auxiliary loss, attention weights, an inner block's hidden state) or the code before
the trunk directly (a connection around it) would take part of a block's gradient in the piece after the
trunk and drop the part that flows into the block's input. So before each micro-batch's piece after the
trunk its loss's graph is walked from the loss: it may reach the last block's output and parameters outside
the trunk, nothing else that requires a gradient (:meth:`LayerMajorBackward._check_tail`; a few nodes for an
HF causal LM, the head and the final norm).

[Note: one pass through the trunk]
The recompute runs block b of micro-batch j from its kept input alone, so the forward must have gone through
each block once, in order, and each block's output must depend on nothing but its input and its own
parameters. Checked as the forward runs: a block entered out of order, twice (a loop over the blocks) or not
at all (HF layerdrop) is refused, and after each block the graph of its output is walked (a few dozen nodes:
the block's own), refusing any other tensor that needs a gradient: keys and values one block stores for
later ones (a ``shared_kv_states`` dict), a tensor made before the trunk and passed to every block (per-layer
inputs, the first hidden state), another block's parameters. A KV cache passed to the blocks, by keyword or
positionally (GPT-2), is dropped: a recompute would append to it a second time.

[Note: dropout in the recompute]
A block's recompute must draw the random numbers its forward drew (dropout masks), or its gradient is taken
through other masks than the output the blocks above saw: a wrong gradient, silently. Each block's forward
of each micro-batch records the random state it starts from (the CPU generator's, and on CUDA its device's)
and the recompute runs from it, the generators put back after (``torch.random.fork_rng``), as
``torch.utils.checkpoint`` does with ``preserve_rng_state``; the recompute draws nothing from the run's
stream. So the gradients are those of the masks the forward used (``tests/test_layer_major.py`` checks them
against autograd over the same masks). What layer-major cannot keep with dropout is DeepSpeed's bits: the
forward draws block 0 for every micro-batch, then block 1, ..., so micro-batch j's masks are other draws of
the same stream than micro-batch by micro-batch. Without dropout (HF Llama, Qwen2, Mistral by default) nothing
is drawn and the note on exactness holds.

[Note: one OS thread]
The k forwards are paused at every block's entry, so each needs a stack of its own; they run as greenlets
(``greenlet``, the stack switching gevent is built on) on the calling thread, switched in a fixed round robin.
Until 2026-12-06 they were OS threads, one per micro-batch, passing a baton: glibc gives each thread that
allocates a malloc arena of its own, which keeps what is freed in it (the micro-batch's logits, its loss's
backward, the head's gradient: 100 MB blocks on a 148M Llama). With the DRAM budget at ``auto`` (freed memory
kept for reuse, ``io/heap.py``) that was 1.4 GiB more peak RSS at 148M fp32 GA 8 (5.93 against 4.52 GiB
micro-batch by micro-batch) and 349k page faults per step. One thread has one arena, and no thread
hand-over on each switch. What PyTorch keeps per thread and a forward may change, gradient mode and on
CUDA the current device and stream (:class:`_TorchThreadState`), is saved when a forward pauses and put back
when it resumes; each starts with the caller's.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterable, Iterator, Protocol

import greenlet
import torch

from .config import AidaptivConfigError
from .trunk import FIX as _FIX
from .trunk import Trunk


class Pieces(Protocol):
    """What the engine does around the pieces of a layer-major step."""

    def hold(self, block: torch.nn.Module) -> None:
        """Keep ``block`` 's parameters gathered until :meth:`unhold` ([Note: one fetch per block])."""

    def unhold(self, block: torch.nn.Module) -> None:
        """``block`` is done for every micro-batch of this phase (forward or backward)."""

    def begin(self, j: int, boundary: bool) -> None:
        """A backward piece of micro-batch ``j`` starts; ``boundary``: it is the last micro-batch's."""

    def end(self) -> None:
        """The piece's gradients are complete in the parameters' ``.grad``: take them (and clear them)."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch loss the backward starts from (``loss / gradient_accumulation_steps``, scaled)."""

    def withhold(self, params: list) -> None:
        """The parameters' gradients stay in ``.grad`` at :meth:`end` until :meth:`release` (tied ones)."""

    def release(self, param) -> None:
        """Take ``param`` 's gradient, now summed, as :meth:`end` takes the others."""

    def keep(self, key: tuple, x: torch.Tensor) -> Any:
        """Keep block ``key[0]`` 's input of micro-batch ``key[1]`` until the backward; returns the token for
        :meth:`take` (the boundary activations: DRAM within the budget, the drives beyond it)."""

    def take(self, token: Any) -> torch.Tensor:
        """The activation kept as ``token``; it is not kept any more."""

    def prefetch(self, tokens: list) -> None:
        """The backward will take these next."""


# ------------------------------------------------------------------------------------------ forward

@dataclasses.dataclass(frozen=True)
class _TorchThreadState:
    """PyTorch's thread-local settings a micro-batch's forward keeps as its own across a switch
    ([Note: one OS thread]): gradient mode, and on CUDA the current device and stream."""
    grad: bool
    device: int | None = None
    stream: Any = None

    @staticmethod
    def capture() -> "_TorchThreadState":
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()
            return _TorchThreadState(torch.is_grad_enabled(), device, torch.cuda.current_stream(device))
        return _TorchThreadState(torch.is_grad_enabled())

    def restore(self) -> None:
        torch.set_grad_enabled(self.grad)
        if self.device is not None:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.stream)


@dataclasses.dataclass(frozen=True)
class _RngState:
    """The random state a block's forward of one micro-batch started from ([Note: dropout in the recompute]):
    the CPU generator's, and on CUDA the block input's device generator's."""
    cpu: torch.Tensor
    device: int | None = None
    cuda: torch.Tensor | None = None

    @staticmethod
    def capture(x: torch.Tensor) -> "_RngState":
        if x.is_cuda:
            return _RngState(torch.get_rng_state(), x.device.index, torch.cuda.get_rng_state(x.device))
        return _RngState(torch.get_rng_state())

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body from this state; the generators are put back as they were after it."""
        with torch.random.fork_rng(devices=[] if self.device is None else [self.device]):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch of a layer-major step.

    Attributes:
        index: 0..k-1, its place in the accumulation window (the order of its gradients).
        inputs: every block's input, the boundary activations the backward recomputes from, as the tokens
            ``Pieces.keep`` returned.
        calls: per block, the call's other arguments: ``calls[b](x)`` is ``(args, kwargs)`` with ``x`` in
            the hidden state's place (masks, rotary tables, as the model passed them).
        head_out: the first block's input as the code before the trunk produced it (with its graph).
        tail_in: the last block's output, the leaf the code after the trunk starts from.
        loss: the model's loss (unscaled; detached once its backward ran).
        grad_out: the gradient the backward hands to the next block down (then to the code before the trunk).
        held: a tied parameter's gradient from the code after the trunk, until the code before it adds its own.
        rng: per block, the random state its forward started from (replayed by the recompute).
    """
    index: int
    inputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    calls: list = dataclasses.field(default_factory=list)
    head_out: torch.Tensor | None = None
    tail_in: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    grad_out: torch.Tensor | None = None
    held: dict = dataclasses.field(default_factory=dict)
    rng: list = dataclasses.field(default_factory=list)


#: keyword arguments of HF decoder layers that carry a KV cache: a training forward has no use for it, and a
#: block's recompute must not append its keys and values to it a second time (the attention would see them twice)
_CACHE_KWARGS = ("cache", "past_key_value", "past_key_values", "layer_past")


def _is_kv_cache(obj: Any) -> bool:
    """An HF KV cache (``transformers.Cache`` or a subclass), found by its class's ancestry so that this module
    needs no ``transformers``."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers")
               for c in type(obj).__mro__)


def _first_tensor(args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any]:
    """The hidden state a block is called with (its first positional argument, else ``hidden_states``)
    and a function that puts a replacement in its place (and no KV cache: ``_CACHE_KWARGS`` and any HF ``Cache``
    passed positionally, as GPT-2's blocks take it)."""
    if any(kwargs.get(k) is not None for k in _CACHE_KWARGS) or any(_is_kv_cache(v) for v in kwargs.values()):
        kwargs = {k: (None if k in _CACHE_KWARGS or _is_kv_cache(v) else v) for k, v in kwargs.items()}
    if any(_is_kv_cache(a) for a in args):
        args = tuple(None if _is_kv_cache(a) else a for a in args)
    # the function keeps the call's other arguments, not the hidden state (the boundary activation is kept apart)
    if args and torch.is_tensor(args[0]):
        rest = args[1:]
        return args[0], lambda x: ((x, *rest), kwargs)
    if torch.is_tensor(kwargs.get("hidden_states")):
        others = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        return kwargs["hidden_states"], lambda x: (args, {**others, "hidden_states": x})
    raise AidaptivConfigError(
        "aidaptiv_ds: layer-major training (engine.train_batch): a block of the trunk was called without its "
        "hidden state as the first argument or as hidden_states=. " + _FIX)


def _output_tensor(output) -> tuple[torch.Tensor, Any]:
    if torch.is_tensor(output):
        return output, lambda y: y
    if isinstance(output, tuple) and output and torch.is_tensor(output[0]):
        return output[0], lambda y: (y, *output[1:])
    raise AidaptivConfigError(
        f"aidaptiv_ds: layer-major training (engine.train_batch): a block of the trunk returned "
        f"{type(output).__name__}; a tensor or a tuple starting with one is needed. " + _FIX)


def _call(module, batch):
    if isinstance(batch, dict):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    return module(batch)


def _loss_of(out) -> torch.Tensor:
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", out)
    if not (torch.is_tensor(loss) and loss.dim() == 0):
        raise AidaptivConfigError(
            f"aidaptiv_ds: layer-major training (engine.train_batch): the model returned {type(out).__name__} "
            f"without a scalar loss; pass labels (HF models) or return the loss. " + _FIX)
    return loss


def _foreign_in_graph(root: torch.Tensor, allowed: Callable[[torch.Tensor], bool], stop: Any = None) -> Any:
    """Walk the autograd graph behind ``root`` and return what it reaches that it may not: the first leaf
    needing a gradient (an ``AccumulateGrad`` node's tensor) for which ``allowed`` is False, or the node ``stop``
    itself; None when there is none ([Note: one way into the trunk], [Note: one pass through the trunk])."""
    seen: set = set()
    stack = [root.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if fn is stop:
            return fn
        var = getattr(fn, "variable", None)  # a leaf's AccumulateGrad
        if var is not None:
            if not allowed(var):
                return var
            continue
        stack.extend(f for f, _ in fn.next_functions)
    return None


def _check_block_graph(y: torch.Tensor, params: frozenset, leaf: torch.Tensor | None, b: int, name: str) -> None:
    """Refuse a block whose output's graph reaches more than its own input and parameters ([Note: one pass
    through the trunk]): a tensor another block made (keys and values shared between blocks), a tensor from
    before the trunk passed to every block (per-layer inputs), another block's parameters.

    Raises:
        AidaptivConfigError: naming the block and the fix.
    """
    if _foreign_in_graph(y, lambda v: v is leaf or id(v) in params) is not None:
        raise AidaptivConfigError(
            f"aidaptiv_ds: layer-major training (engine.train_batch): block {b} of {name} computes its output "
            "from more than its input and its own parameters (a tensor made before the trunk and passed to "
            "every block, such as per-layer inputs or the first hidden state; keys and values shared between "
            "blocks); its recompute in backward would lose that gradient. " + _FIX)


def layer_major_forward(model: torch.nn.Module, trunk: Trunk, batches: list, pieces: Pieces,
                        on_loss: Callable[[MicroBatch], None] | None = None) -> list[MicroBatch]:
    """Run ``model`` on ``batches`` block by block ([Note: layer-major order], [Note: one OS thread]).
    ``on_loss(rec)`` runs as each micro-batch's loss is there, in order (:meth:`LayerMajorBackward.tail`: its
    backward down to the trunk, so that the k micro-batches' logits are not all held until the backward).

    Returns:
        One :class:`MicroBatch` per batch, with its loss (a graph back to the trunk's output), its
        boundary activations and the code before the trunk's output (a graph back to the inputs).

    Raises:
        whatever the model raised for a micro-batch (the first one; the others' forwards are unwound then).
    """
    k = len(batches)
    recs = [MicroBatch(j) for j in range(k)]
    last = len(trunk.blocks) - 1
    scheduler = greenlet.getcurrent()
    index: dict = {}  # greenlet -> its micro-batch
    leaves: list = [None] * k  # each micro-batch's input leaf of the block it runs

    def yield_turn() -> None:
        own = _TorchThreadState.capture()
        scheduler.switch()  # the next micro-batch runs to the same point
        own.restore()

    def pre(b):
        def hook(module, args, kwargs):
            j = index[greenlet.getcurrent()]
            if len(recs[j].inputs) != b:  # [Note: one pass through the trunk]
                raise AidaptivConfigError(
                    f"aidaptiv_ds: layer-major training (engine.train_batch): micro-batch {j} entered block {b} of "
                    f"{trunk.name} after {len(recs[j].inputs)} blocks; each block once, in order, is needed (a "
                    "trunk run twice, a loop over its blocks, or blocks skipped: HF layerdrop). " + _FIX)
            x, put = _first_tensor(args, kwargs)
            if b == 0:
                recs[j].head_out = x
            yield_turn()  # every micro-batch reaches block b before any runs it
            if j == 0:
                pieces.hold(module)
            recs[j].inputs.append(pieces.keep((b, j), x.detach()))
            recs[j].calls.append(put)
            recs[j].rng.append(_RngState.capture(x))  # [Note: dropout in the recompute]
            # the block runs as in the oracle's forward (gradients on, its input requiring them), but its graph
            # ends at its input and is freed with its output: the backward recomputes it
            leaves[j] = x.detach().requires_grad_(x.requires_grad)
            return put(leaves[j])
        return hook

    def post(b):
        def hook(module, args, output):
            j = index[greenlet.getcurrent()]
            y, put = _output_tensor(output)
            _check_block_graph(y, trunk.block_param_ids[b], leaves[j], b, trunk.name)
            leaves[j] = None
            yd = y.detach().requires_grad_(y.requires_grad)  # the next block's input, as in the oracle
            if j == k - 1:
                pieces.unhold(module)
            if b == last:
                recs[j].tail_in = yd
                yield_turn()  # the last block for every micro-batch before the code after the trunk
            return put(yd)
        return hook

    def run(j: int) -> None:
        out = _call(model, batches[j])
        if len(recs[j].inputs) != last + 1:  # [Note: one pass through the trunk]
            raise AidaptivConfigError(
                f"aidaptiv_ds: layer-major training (engine.train_batch): micro-batch {j} ran {len(recs[j].inputs)} "
                f"of the {last + 1} blocks of {trunk.name}; each block once, in order, is needed (blocks skipped: "
                "HF layerdrop). " + _FIX)
        recs[j].loss = _loss_of(out)
        if on_loss is not None:
            on_loss(recs[j])

    caller = _TorchThreadState.capture()
    forwards = [greenlet.greenlet(lambda j=j: run(j)) for j in range(k)]
    index.update({g: j for j, g in enumerate(forwards)})
    handles = []
    try:
        for b, block in enumerate(trunk.blocks):
            handles.append(block.register_forward_pre_hook(pre(b), prepend=True, with_kwargs=True))
            handles.append(block.register_forward_hook(post(b)))
        while not all(g.dead for g in forwards):
            for g in forwards:  # round robin: each runs to its next switch (a block's entry) or its end
                if not g.dead:
                    caller.restore()  # a micro-batch starts with the caller's settings, resumes with its own
                    g.switch()
    except BaseException:
        for g in forwards:  # unwind the others' frames now (their ``with`` blocks, DeepSpeed's hooks)
            if g:
                g.throw(greenlet.GreenletExit)
        raise
    finally:
        for h in handles:
            h.remove()
        caller.restore()
    return recs


def micro_batches(data_iter: Iterable | Iterator, k: int) -> list:
    """The next ``k`` micro-batches of ``data_iter``.

    Raises:
        AidaptivConfigError: it ends before ``k``.
    """
    it = iter(data_iter)
    out = []
    for _ in range(k):
        try:
            out.append(next(it))
        except StopIteration:
            raise AidaptivConfigError(
                f"aidaptiv_ds: engine.train_batch(data_iter) needs gradient_accumulation_steps={k} micro-batches "
                f"per call; data_iter ended after {len(out)}. Fix: pass an iterator with at least {k} more "
                f"(DeepSpeed's PipelineEngine.train_batch takes the same).") from None
    return out




# ------------------------------------------------------------------------------------------ backward

class LayerMajorBackward:
    """The backward of a layer-major step, in pieces ([Note: layer-major order]): the code after the trunk for
    each micro-batch (:meth:`tail`, as soon as its loss is there when the forward calls it), each block from
    the last to the first for each micro-batch (recomputed from its kept input), the code before the trunk for
    each micro-batch (:meth:`finish`). ``tied``: parameters used both before and after the trunk ([Note: exact
    against micro-batch-major]); ``start``: called before the first piece (the engine opens its backward).
    """

    def __init__(self, trunk: Trunk, k: int, tied: list, pieces: Pieces,
                 start: Callable[[], None] | None = None) -> None:
        self.trunk, self.k, self.tied, self.pieces, self._start = trunk, k, list(tied), pieces, start
        self.started = False

    def _begin(self) -> None:
        if not self.started:
            self.started = True
            if self._start is not None:
                self._start()
            self.pieces.withhold(self.tied)

    def tail(self, rec: MicroBatch) -> None:
        """Micro-batch ``rec`` 's piece after the trunk: from its loss to the trunk's output."""
        self._begin()
        pieces = self.pieces
        assert rec.loss is not None and rec.tail_in is not None
        self._check_tail(rec)
        pieces.begin(rec.index, rec.index == self.k - 1)
        pieces.scale(rec.loss).backward()
        for p in self.tied:
            rec.held[p] = p.grad
            p.grad = None
        pieces.end()
        rec.grad_out = rec.tail_in.grad
        rec.tail_in, rec.loss = None, rec.loss.detach()

    def _check_tail(self, rec: MicroBatch) -> None:
        """Refuse a loss whose graph reaches the trunk other than through the last block's output
        ([Note: one way into the trunk]).

        Raises:
            AidaptivConfigError: the loss's graph reaches a block's parameter, a tensor the forward cut off
                at a block's boundary, or the trunk's input (the code before the trunk) directly.
        """
        assert rec.loss is not None
        stop = rec.head_out.grad_fn if rec.head_out is not None else None
        trunk = self.trunk.param_ids
        bad = _foreign_in_graph(rec.loss, lambda v: v is rec.tail_in or (
            isinstance(v, torch.nn.Parameter) and id(v) not in trunk), stop)
        if bad is None:
            return
        what = ("a parameter of the trunk's blocks" if id(bad) in trunk else
                "the trunk's input" if bad is stop or bad is rec.head_out else "a tensor cut off at a block's boundary")
        raise AidaptivConfigError(
            f"aidaptiv_ds: layer-major training (engine.train_batch): the loss reaches {what} other than "
            "through the last block's output (e.g. an MoE router's auxiliary loss, output_router_logits="
            "True; attention weights or hidden states of inner blocks, output_attentions or "
            "output_hidden_states; a connection around the trunk): the backward runs block by block from "
            "the trunk's output and would lose that gradient. Fix: leave those outputs out of the loss, or "
            "train micro-batch by micro-batch (engine(batch), engine.backward, engine.step).")

    def finish(self, recs: list[MicroBatch]) -> None:
        """The rest: the tails not run yet, the blocks, the code before the trunk.

        Raises:
            AidaptivConfigError: a tied parameter got a gradient after the trunk and none before it.
        """
        self._begin()
        pieces, k = self.pieces, self.k
        for rec in recs:
            if rec.tail_in is not None:
                self.tail(rec)
        for b in reversed(range(len(self.trunk.blocks))):
            block = self.trunk.blocks[b]
            pieces.prefetch([rec.inputs[b] for rec in recs] + ([rec.inputs[b - 1] for rec in recs] if b else []))
            pieces.hold(block)
            for rec in recs:
                pieces.begin(rec.index, rec.index == k - 1)
                x = pieces.take(rec.inputs[b]).requires_grad_(True)
                if rec.grad_out is not None:  # None: nothing above needs a gradient (frozen blocks and head)
                    args, kwargs = rec.calls[b](x)
                    with rec.rng[b].replay():  # the masks its forward drew ([Note: dropout in the recompute])
                        y, _ = _output_tensor(block(*args, **kwargs))
                    if y.requires_grad:
                        torch.autograd.backward(y, rec.grad_out)
                pieces.end()
                rec.grad_out = x.grad
                rec.inputs[b], rec.calls[b], rec.rng[b] = None, None, None  # this boundary activation is done
            pieces.unhold(block)
        for rec in recs:  # the code before the trunk
            pieces.begin(rec.index, rec.index == k - 1)
            if rec.head_out is not None and rec.head_out.requires_grad and rec.grad_out is not None:
                torch.autograd.backward(rec.head_out, rec.grad_out)
            for p, g in rec.held.items():
                if g is None:
                    continue
                if p.grad is None:
                    raise AidaptivConfigError(
                        "aidaptiv_ds: layer-major training (engine.train_batch): a parameter used before and after "
                        "the trunk got a gradient only after it. " + _FIX)
                p.grad.add_(g)  # autograd's sum of the parameter's two gradients of this micro-batch
                pieces.release(p)
            pieces.end()
            rec.head_out, rec.grad_out, rec.held = None, None, {}
