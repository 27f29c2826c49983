"""One Adam/AdamW tile over moments stored as bf16, fused into one loop by ``torch.compile``
(``"optimizer_state": {"moments": "bf16", "fused_step": "auto"}``).

[Note: why a fused tile]
The eager tiled step (``integration/host_step.py``) runs torch's ``adam`` on each tile: about a dozen ATen
passes, and with bf16 moments four more (widen both moments into fp32 scratch, round both back). Inductor's
C++ backend compiles the whole update (widen, ``lerp``, the second moment, the denominator, the parameter
update, the rounding) into one loop that reads ``p, g, m, v`` once and writes ``p, m, v`` once, in place (no
temporaries). Per 20M-element sub-group in 2M-element tiles on the 2-core VM (``python
launch/fused_adam_tile.py``; docs/profiling.md, "The fused bf16 tile lands"): eager fp32 moments 26.6 ms, eager
bf16 33.3 ms, fused bf16 15.3 ms.

[Note: not torch's bits]
The tile evaluates the formulas of torch's ``_single_tensor_adam`` in the same order, every operation rounded
in fp32 on its own (inductor compiles with ``-ffp-contract=off``; its ``sqrt`` is the IEEE instruction).
torch's eager CPU kernels differ in two places, probed on torch 2.13: ``lerp`` and ``addcmul`` are fused
multiply-adds, and ``sqrt`` is MKL VML's, which is not correctly rounded on every element (205,535 of 1M
differ from the fp64 square root rounded). So the fused tile is not bit-identical with the eager widened tile:
after one step on a 1M-element tile, 11-36 moments of 1M differ (by a bf16 step, more where the moment is
near zero) and the parameters by at most 2.4e-7; after five steps, by at most 1.5e-5 at a learning rate of
1e-3 (:func:`_probe` checks this kind of agreement on every machine before the tile is used). fp32 moments,
whose promise is DeepSpeed's bits, never take it; bf16 moments, not bit-identical with fp32 moments anyway,
take it by default; ``"fused_step": "off"`` keeps the eager tile, bit-identical with the rounded-moment
oracle.

[Note: compiling once]
:func:`bf16_tile` compiles the tile at configuration time, on the calling (main) thread, with dynamic shapes
and under ``no_grad`` as the step runs it, in this process (``compile_threads=1``: no pool of compile
workers inside a training rank), and checks it on a probe tile against the eager tile. Tiles of any
length and offset then reuse that one kernel (``tests/test_fused_adam.py`` counts the compiles), from any
thread. The step's scalars (learning rate, betas, bias corrections) travel in one fp32 tensor, so a
learning-rate schedule does not recompile. Inductor caches the kernel on disk: the first process compiles in
about 6 s, later ones load it in about 2. Where no C++ compiler works, ``"auto"`` warns once and keeps the eager
tile; ``"on"`` refuses, naming the fix.
"""
from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Callable

import torch

from ..errors import AidaptivConfigError, AidaptivWarning

log = logging.getLogger(__name__)

#: the order of the scalars of :func:`step_scalars` (one fp32 tensor, so a new learning rate does not recompile)
SCALARS = ("grad_sign", "coupled_decay", "lerp_weight", "beta2", "one_minus_beta2", "bias_correction2_sqrt",
           "eps", "decoupled_decay", "neg_step_size")


def _tile(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> None:
    """The update of ``_single_tensor_adam`` (torch/optim/adam.py) for one tile, in place: ``p`` fp32, ``g``
    fp32, ``m``/``v`` bf16 (widened here, rounded back to nearest even), all ``(n,)``; ``s``: fp32
    ``(len(SCALARS),)``."""
    grad = g * s[0] + p * s[1]  # maximize's sign; Adam's L2 term (0 for AdamW)
    mf = torch.lerp(m.float(), grad, s[2])
    vf = v.float() * s[3] + (s[4] * grad) * grad
    denom = vf.sqrt() / s[5] + s[6]
    p.copy_(p * s[7] + (s[8] * mf) / denom)
    m.copy_(mf)
    v.copy_(vf)


def step_scalars(group: dict, step: float) -> torch.Tensor:
    """The scalars of step number ``step`` (after torch's increment) for ``group``'s hyperparameters, as torch's
    ``_single_tensor_adam`` computes them in Python floats, then rounded to fp32 as ATen does for an fp32
    tensor (:data:`SCALARS` order).

    Raises:
        TypeError: a hyperparameter is not a number (a tensor learning rate: the caller steps eagerly).
    """
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    decoupled = bool(group.get("decoupled_weight_decay", False))
    step_size = lr / (1 - beta1 ** step)
    bc2_sqrt = (1 - beta2 ** step) ** 0.5
    vals = (-1.0 if group.get("maximize") else 1.0, 0.0 if decoupled else wd, 1 - beta1, beta2, 1 - beta2,
            bc2_sqrt, eps, 1 - lr * wd if decoupled else 1.0, -step_size)
    return torch.tensor(vals, dtype=torch.float32)


class _Compiled:
    """The process's one compiled tile, or why there is none ([Note: compiling once])."""
    lock = threading.Lock()
    kernel: Callable | None = None
    error: str | None = None
    warned = False


def bf16_tile(mode: str) -> Callable | None:
    """The fused tile for bf16 moments under ``"fused_step": mode``, compiled and probed on first use.

    Args:
        mode: ``"auto"`` (the fused tile where it compiles and passes the probe, else None with a warning),
            ``"on"`` (the fused tile, else raise) or ``"off"`` (None: the eager tile).

    Returns:
        ``tile(p, g, m, v, scalars)`` (see :func:`_tile`; call it under ``torch.no_grad()``), or None.

    Raises:
        AidaptivConfigError: ``mode`` is ``"on"`` and the tile does not compile or fails the probe; or
            ``mode`` is none of the three.
    """
    if mode not in ("auto", "on", "off"):
        raise AidaptivConfigError(f"aidaptiv.optimizer_state.fused_step is {mode!r}. Fix: \"auto\", \"on\" or "
                                  f"\"off\"")
    if mode == "off":
        return None
    with _Compiled.lock:
        if _Compiled.kernel is None and _Compiled.error is None:
            _compile()
    if _Compiled.kernel is not None:
        return _Compiled.kernel
    if mode == "on":
        raise AidaptivConfigError(
            f"aidaptiv.optimizer_state.fused_step is \"on\", but the fused bf16 Adam tile is not available: "
            f"{_Compiled.error}. Fix: install a C++ compiler torch.compile can use (gcc or clang), or set "
            f"\"fused_step\": \"auto\" or \"off\" (the eager tile)")
    if not _Compiled.warned:
        _Compiled.warned = True
        warnings.warn(f"aidaptiv_ds: bf16 moments step with the eager tile ({_Compiled.error}); the fused tile is "
                      f"faster (optimizer_state.fused_step, tiers/fused_adam.py)", AidaptivWarning, stacklevel=2)
    return None


def _compile() -> None:
    """Compile and probe the tile into :class:`_Compiled` (under its lock)."""
    if os.environ.get("TORCH_COMPILE_DISABLE", "0") not in ("", "0"):
        _Compiled.error = "TORCH_COMPILE_DISABLE is set"
        return
    try:
        from torch._inductor import config as inductor_config
        kernel = torch.compile(_tile, dynamic=True, fullgraph=True)
        # in this process: no pool of compile workers inside a training rank, for one small kernel
        with torch.no_grad(), inductor_config.patch(compile_threads=1):
            _probe(kernel)
    except Exception as e:  # no compiler, an inductor failure, or a probe that disagrees
        cause: BaseException = e
        while cause.__cause__ is not None:  # inductor's BackendCompilerFailed wraps what failed
            cause = cause.__cause__
        lines = [ln for ln in str(cause).splitlines() if ln.strip()]
        _Compiled.error = f"{type(cause).__name__}: {lines[0][:200] if lines else ''}"
        log.warning("fused bf16 Adam tile unavailable: %s", _Compiled.error)
        return
    _Compiled.kernel = kernel


def eager_tile(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, group: dict,
               step: float) -> None:
    """The eager widened tile the fused one is checked against: torch's ``adam`` on ``m``/``v`` widened to
    fp32, rounded back (what ``integration/host_step.py`` runs with ``"fused_step": "off"``)."""
    from torch.optim.adam import adam
    beta1, beta2 = group["betas"]
    mf, vf = m.float(), v.float()
    adam([p], [g], [mf], [vf], [], [torch.tensor(float(step - 1))], amsgrad=False, has_complex=False,
         beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
         maximize=bool(group.get("maximize")), foreach=False, capturable=False, differentiable=False, fused=False,
         grad_scale=None, found_inf=None, decoupled_weight_decay=bool(group.get("decoupled_weight_decay")))
    m.copy_(mf)
    v.copy_(vf)


def moments_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two bf16 moments of the same step agree as [Note: not torch's bits] promises: at most 1% of the
    elements differ, and each by at most two bf16 steps of its own size (``2**-7 * |b|``) or a bf16 step of the
    tile's largest magnitude (``2**-8 * max|b|``: near zero a moment is the difference of two close numbers)."""
    af, bf = a.float(), b.float()
    diff = (af - bf).abs()
    bound = 2.0 ** -7 * bf.abs() + 2.0 ** -8 * bf.abs().max()
    return bool((diff <= bound).all()) and (af != bf).float().mean().item() <= 0.01


def _probe(kernel: Callable, n: int = 4099) -> None:
    """Run ``kernel`` and :func:`eager_tile` on the same random tile (``n`` elements at an offset, an odd
    length for the loop's tail; AdamW and Adam with an L2 term, two steps) and raise ``RuntimeError`` unless
    the moments are :func:`moments_close` and the parameters within 1e-6 relative plus 1% of the
    learning rate (a wrong formula moves them by about the learning rate)."""
    gen = torch.Generator().manual_seed(0)
    for decoupled in (True, False):
        lr = 1e-3
        group = {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "maximize": False,
                 "decoupled_weight_decay": decoupled}
        p = torch.randn(n + 7, generator=gen)
        m = (torch.randn(n + 7, generator=gen) * 1e-2).bfloat16()
        v = (torch.rand(n + 7, generator=gen) * 1e-4).bfloat16()
        ref = [p.clone(), m.clone(), v.clone()]
        for step in (1, 2):
            g = torch.randn(n + 7, generator=gen) * 1e-2
            kernel(p[7:], g[7:], m[7:], v[7:], step_scalars(group, step))
            eager_tile(ref[0][7:], g[7:], ref[1][7:], ref[2][7:], group, step)
        if not (torch.equal(p[:7], ref[0][:7]) and torch.equal(m[:7], ref[1][:7])):
            raise RuntimeError("the compiled tile wrote outside its tile")
        drift = ((p - ref[0]).abs() - 1e-6 * ref[0].abs()).max().item()
        if not (moments_close(m, ref[1]) and moments_close(v, ref[2])) or drift > 0.01 * lr:
            raise RuntimeError(f"the compiled tile disagrees with torch's eager tile on this machine (moments "
                               f"close: {moments_close(m, ref[1])}/{moments_close(v, ref[2])}, parameters "
                               f"{drift:.3g} beyond 1e-6 relative)")
