"""One Adam/AdamW tile over moments stored as bf16 or int8, fused into one loop by ``torch.compile``
(``"optimizer_state": {"moments": "bf16" | "int8", "fused_step": "auto"}``).

[Note: why a fused tile]
The eager tiled step (``integration/host_step.py``) runs torch's ``adam`` on each tile: about a dozen ATen
passes, and with narrow moments more around them (bf16: widen both moments into fp32 scratch, round both back;
int8: decode through the map, and the per-block absmax, scaling and table lookup of the encode). Inductor's C++
backend compiles the whole update (decode, ``lerp``, the second moment, the denominator, the parameter update,
the encode) into one loop that reads ``p, g`` and the moments once and writes ``p`` and the moments once, in
place (no temporaries). Per 20M-element sub-group in 2M-element tiles on the 2-core VM (``python
launch/fused_adam_tile.py``, two runs; docs/profiling.md, "The fused bf16 tile lands" and "... and int8's"):
eager fp32 moments 22.7 / 23.6 ms; bf16 eager 31.6, fused 18.2 / 16.5; int8 eager 73.7 / 76.4, fused 34.0 / 35.2.

[Note: not torch's bits]
The tile evaluates the formulas of torch's ``_single_tensor_adam`` in the same order, every operation rounded
in fp32 on its own (inductor compiles with ``-ffp-contract=off``; its ``sqrt`` is the IEEE instruction).
torch's eager CPU kernels differ in two places, probed on torch 2.13: ``lerp`` and ``addcmul`` are fused
multiply-adds, and ``sqrt`` is MKL VML's, which is not correctly rounded on every element (205,535 of 1M
differ from the fp64 square root rounded). So the fused tile is not bit-identical with the eager widened tile:
after one step on a 1M-element tile, 11-36 moments of 1M differ (by a bf16 step, more where the moment is
near zero) and the parameters by at most 2.4e-7; after five steps, by at most 1.5e-5 at a learning rate of
1e-3. int8 codes the same fp32 moments the same way (the same map, table and scales); only where the fp32
update differs can a code or a block's scale move (:func:`int8_moments_close`). :func:`_probe` checks this kind
of agreement on every machine before a tile is used. fp32 moments, whose promise is DeepSpeed's bits, never
take it; bf16 and int8 moments, not bit-identical with fp32 moments anyway, take it by default; ``"fused_step":
"off"`` keeps the eager tile, bit-identical with the rounded (round-tripped) moment oracle.

[Note: compiling once]
:func:`fused_tile` compiles the tile at configuration time, on the calling (main) thread, with dynamic shapes
and under ``no_grad`` as the step runs it, and checks it on probe tiles against the eager tile. Every compile
of the tile, then or later, runs in this process (``compile_threads=1``: no pool of compile workers inside a
training rank) and without duck shapes (:func:`_compile_settings`). Dynamic shapes cover the tiles' lengths and
offsets, but the compiler also guards on how each tile views its buffer: storage offsets of 0 and 1, and
whether a tile is its base's whole length. The probe's tiles are cut from larger buffers, at offset 0 and past
it, as a step's are: the engine tests' steps then compile nothing more (``TORCH_LOGS=recompiles``, bf16 and
int8), and every step, length, learning rate (the scalars travel in one fp32 tensor) and thread reuses the
probed kernels (``tests/test_fused_adam.py`` counts the compiles). A variant a step does need compiles there,
under the same settings. Tiles shorter than :attr:`FusedTile.min_numel` go to the
eager tile (a dimension of 1 is specialized too). Inductor caches the kernels on disk: the first process
compiles in about 6 s, later ones load them in about 2. Where no C++ compiler works, ``"auto"`` warns once
and keeps the eager tile; ``"on"`` refuses, naming the fix.

[Note: a failure inside the step]
A call that raises inside a step (a compile the probe did not foresee failing, say) has written nothing of its
tile: the host step finishes that step's remaining tiles with the eager tile, and :meth:`FusedTile.failed`
retires the fused tile for the process with a warning. The step is never left half-updated.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..errors import AidaptivConfigError, AidaptivWarning
from . import blockwise

log = logging.getLogger(__name__)

#: the order of the scalars of :func:`step_scalars` (one fp32 tensor, so a new learning rate does not recompile)
SCALARS = ("grad_sign", "coupled_decay", "lerp_weight", "beta2", "one_minus_beta2", "bias_correction2_sqrt",
           "eps", "decoupled_decay", "neg_step_size")


def _grad(p: torch.Tensor, g: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The gradient the moments see: maximize's sign, plus Adam's L2 term where there is one (skipped, not
    multiplied by 0, as torch skips it: an inf parameter must not make the moments NaN)."""
    return torch.where(s[1] != 0, g * s[0] + p * s[1], g * s[0])


def _tile(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> None:
    """The update of ``_single_tensor_adam`` (torch/optim/adam.py) for one tile, in place: ``p`` fp32, ``g``
    fp32, ``m``/``v`` bf16 (widened here, rounded back to nearest even), all ``(n,)``; ``s``: fp32
    ``(len(SCALARS),)``."""
    grad = _grad(p, g, s)
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
        TypeError: a hyperparameter is not a number (a tensor learning rate is refused earlier: the host step
            keeps the eager tile for one).
    """
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    decoupled = bool(group.get("decoupled_weight_decay", False))
    step_size = lr / (1 - beta1 ** step)
    bc2_sqrt = (1 - beta2 ** step) ** 0.5
    vals = (-1.0 if group.get("maximize") else 1.0, 0.0 if decoupled else wd, 1 - beta1, beta2, 1 - beta2,
            bc2_sqrt, eps, 1 - lr * wd if decoupled else 1.0, -step_size)
    return torch.tensor(vals, dtype=torch.float32)


def _int8_tile(p: torch.Tensor, g: torch.Tensor, cm: torch.Tensor, sm: torch.Tensor, cv: torch.Tensor,
               sv: torch.Tensor, s: torch.Tensor, qm: torch.Tensor, qv: torch.Tensor, tm: torch.Tensor,
               tv: torch.Tensor) -> None:
    """:func:`_tile` over int8 moments, in place: ``p``/``g`` fp32 and the codes ``cm``/``cv`` uint8, all
    ``(blocks, BLOCK)``; the scales ``sm``/``sv`` fp32 ``(blocks,)``; ``qm``/``qv`` the signed / unsigned maps and
    ``tm``/``tv`` their code tables (``tiers/blockwise.py``: the same decoding, scales and table lookup as
    ``blockwise.dequantize`` / ``quantize``, so equal fp32 moments give equal codes)."""
    mf = qm[cm.int()] * sm[:, None]
    vf = qv[cv.int()] * sv[:, None]
    grad = _grad(p, g, s)
    mf = torch.lerp(mf, grad, s[2])
    vf = vf * s[3] + (s[4] * grad) * grad
    p.copy_(p * s[7] + (s[8] * mf) / (vf.sqrt() / s[5] + s[6]))
    # both blocks' |x| maxima before any code is written: one reduction each, in the update's loop (the same
    # value as blockwise.quantize's max(amax, -amin), NaN included; the clip makes a zero block's sign moot)
    am, av = mf.abs().amax(-1).clamp_min(1e-12), vf.abs().amax(-1).clamp_min(1e-12)
    for x, a, codes, scales, table in ((mf, am, cm, sm, tm), (vf, av, cv, sv, tv)):
        bits = (x / a[:, None]).view(torch.int32)
        idx = (bits >> blockwise.TABLE_SHIFT) & ((1 << (32 - blockwise.TABLE_SHIFT)) - 1)
        codes.copy_(table[idx])
        scales.copy_(a)


_CALL_LOCK = threading.Lock()


@contextlib.contextmanager
def _compile_settings():
    """The settings any compile of the tile runs under, at configuration or at a later call ([Note: compiling
    once]): in this process (``compile_threads=1``: no pool of compile workers inside a training rank, for one
    small kernel) and without duck shapes (no two sizes or offsets assumed equal because they were equal once).
    The settings are process-wide (inductor's config): :data:`_CALL_LOCK` keeps two tiles' calls from interleaving
    their set and restore; a compile of the user's own in another thread meanwhile would see them, and still be
    right. About 24 us per call, 2 ms per 148M step."""
    from torch._inductor import config as inductor_config
    from torch.fx.experimental import _config as fx_config
    with _CALL_LOCK, inductor_config.patch(compile_threads=1), \
            fx_config.patch(use_duck_shape=False):  # type: ignore[attr-defined]
        yield


@dataclasses.dataclass(frozen=True)
class FusedTile:
    """A compiled tile for one moment format (call it under ``torch.no_grad()``).

    ``moments == "bf16"``: ``tile(p, g, m, v, scalars)``, all ``(n,)`` (:func:`_tile`). ``"int8"``:
    ``tile(p, g, codes_m, scales_m, codes_v, scales_v, scalars)`` over whole blocks: ``p, g, codes`` ``(n,)`` with
    ``n`` a multiple of :data:`~aidaptiv_ds.tiers.blockwise.BLOCK` of at least :attr:`min_numel` elements, scales
    ``(n // BLOCK,)`` (:func:`_int8_tile`); a unit's short last block and tiles of one block take the eager tile.
    """
    moments: str
    kernel: Callable

    @property
    def min_numel(self) -> int:
        """The fewest elements one call takes: two (int8: two blocks). The compiler specializes a dimension of 1,
        so a shorter tile would compile a second kernel inside the step; the host step hands it to the eager tile."""
        return 2 * blockwise.BLOCK if self.moments == "int8" else 2

    @property
    def usable(self) -> bool:
        """Still this process's tile: False once a call failed ([Note: a failure inside the step])."""
        return _COMPILED[self.moments].tile is self

    def failed(self, error: BaseException) -> None:
        """Stop using this tile in the process after ``error`` inside a step (the caller finishes the step with
        the eager tile), with a warning naming the error."""
        st = _COMPILED[self.moments]
        if st.tile is self:
            st.tile, st.error = None, f"{type(error).__name__}: {error}"[:300]
            warnings.warn(f"aidaptiv_ds: the fused {self.moments} Adam tile failed inside the step ({st.error}); this "
                          f"step and the next ones use the eager tile", AidaptivWarning, stacklevel=3)

    def __call__(self, p: torch.Tensor, g: torch.Tensor, *rest: torch.Tensor) -> None:
        if self.moments == "bf16":
            if p.numel() < self.min_numel:
                raise ValueError(f"the fused bf16 tile takes at least {self.min_numel} elements, not {p.numel()}")
            with _compile_settings():
                self.kernel(p, g, *rest)
            return
        cm, sm, cv, sv, s = rest
        if p.numel() % blockwise.BLOCK or p.numel() < self.min_numel:
            raise ValueError(f"the fused int8 tile takes whole blocks of {blockwise.BLOCK}, at least "
                             f"{self.min_numel} elements, not {p.numel()}")
        blocks = [t.view(-1, blockwise.BLOCK) for t in (p, g, cm)] + [sm, cv.view(-1, blockwise.BLOCK), sv]
        for t in blocks:
            torch._dynamo.mark_dynamic(t, 0)  # any number of blocks, the block itself static
        with _compile_settings():
            self.kernel(*blocks, s, blockwise.qmap(True), blockwise.qmap(False), blockwise.code_table(True),
                        blockwise.code_table(False))


@dataclasses.dataclass
class _Compiled:
    """One moment format's compiled tile in this process, or why there is none ([Note: compiling once])."""
    tile: FusedTile | None = None
    error: str | None = None
    warned: bool = False


_LOCK = threading.Lock()
_COMPILED = {"bf16": _Compiled(), "int8": _Compiled()}


def fused_tile(moments: str, mode: str) -> FusedTile | None:
    """The fused tile for ``moments`` (``"bf16"`` or ``"int8"``) under ``"fused_step": mode``, compiled and
    probed on first use in the process.

    Args:
        moments: the moments' format (``optimizer_state.moments``); fp32 moments have no fused tile.
        mode: ``"auto"`` (the fused tile where it compiles and passes the probe, else None with a warning),
            ``"on"`` (the fused tile, else raise) or ``"off"`` (None: the eager tile).

    Returns:
        The :class:`FusedTile`, or None.

    Raises:
        AidaptivConfigError: ``mode`` is ``"on"`` and the tile does not compile or fails the probe; or
            ``mode`` is none of the three; or ``moments`` has no fused tile.
    """
    if mode not in ("auto", "on", "off"):
        raise AidaptivConfigError(f"aidaptiv.optimizer_state.fused_step is {mode!r}. Fix: \"auto\", \"on\" or "
                                  f"\"off\"")
    if moments not in _COMPILED:
        raise AidaptivConfigError(f"aidaptiv.optimizer_state.moments is {moments!r}, which has no fused tile (bf16 and "
                                  f"int8 have). Fix: \"fused_step\": \"off\"")
    if mode == "off":
        return None
    st = _COMPILED[moments]
    with _LOCK:
        if st.tile is None and st.error is None:
            _compile(moments, st)
    if st.tile is not None:
        return st.tile
    if mode == "on":
        raise AidaptivConfigError(
            f"aidaptiv.optimizer_state.fused_step is \"on\", but the fused {moments} Adam tile is not available: "
            f"{st.error}. Fix: install a C++ compiler torch.compile can use (gcc or clang), or set "
            f"\"fused_step\": \"auto\" or \"off\" (the eager tile)")
    if not st.warned:
        st.warned = True
        warnings.warn(f"aidaptiv_ds: {moments} moments step with the eager tile ({st.error}); the fused tile is "
                      f"faster (optimizer_state.fused_step, tiers/fused_adam.py)", AidaptivWarning, stacklevel=3)
    return None


def _compile(moments: str, st: _Compiled) -> None:
    """Compile and probe ``moments``' tile into ``st`` (under :data:`_LOCK`)."""
    if os.environ.get("TORCH_COMPILE_DISABLE", "0") not in ("", "0"):
        st.error = "TORCH_COMPILE_DISABLE is set"
        return
    try:
        if moments == "bf16":
            tile = FusedTile("bf16", torch.compile(_tile, dynamic=True, fullgraph=True))
        else:
            blockwise.quantizer_available()
            tile = FusedTile("int8", torch.compile(_int8_tile, dynamic=False, fullgraph=True))
        with torch.no_grad():
            _probe(tile)
    except Exception as e:  # no compiler, an inductor failure, or a probe that disagrees
        cause: BaseException = e
        while cause.__cause__ is not None:  # inductor's BackendCompilerFailed wraps what failed
            cause = cause.__cause__
        lines = [ln for ln in str(cause).splitlines() if ln.strip()]
        st.error = f"{type(cause).__name__}: {lines[0][:200] if lines else ''}"
        log.warning("fused %s Adam tile unavailable: %s", moments, st.error)
        return
    st.tile = tile


def adam_kwargs(group: dict) -> dict:
    """The keyword arguments of torch's single-tensor ``torch.optim.adam.adam`` for one param group of a
    ``torch.optim.Adam``/``AdamW``: its hyperparameters, and the single-tensor CPU path (no foreach, fused,
    capturable or grad scaling). The eager tile of ``integration/host_step.py`` and :func:`eager_tile` both call
    ``adam`` with them."""
    beta1, beta2 = group["betas"]
    return dict(amsgrad=bool(group.get("amsgrad")), has_complex=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=bool(group.get("maximize")),
                foreach=False, capturable=False, differentiable=False, fused=False, grad_scale=None, found_inf=None,
                decoupled_weight_decay=bool(group.get("decoupled_weight_decay")))


def eager_tile(p: torch.Tensor, g: torch.Tensor, m: Any, v: Any, group: dict,
               step: float) -> None:
    """The eager widened tile the fused one is checked against: torch's ``adam`` on ``m``/``v`` widened to
    fp32, rounded back (what ``integration/host_step.py`` runs with ``"fused_step": "off"``). ``m``/``v`` bf16
    ``(n,)``, or ``(codes, scales)`` pairs of int8 moments (dequantized, stepped, quantized again)."""
    from torch.optim.adam import adam
    if isinstance(m, tuple):
        mf, vf = blockwise.dequantize(m[0], m[1], True), blockwise.dequantize(v[0], v[1], False)
    else:
        mf, vf = m.float(), v.float()
    adam([p], [g], [mf], [vf], [], [torch.tensor(float(step - 1))], **adam_kwargs(group))
    if isinstance(m, tuple):
        blockwise.quantize(mf, m[0], m[1], True)
        blockwise.quantize(vf, v[0], v[1], False)
    else:
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


def int8_moments_close(a: tuple, b: tuple, signed: bool) -> bool:
    """Whether two int8 moments ``(codes, scales)`` of the same step agree as [Note: not torch's bits] promises
    for int8: at most 1% of the codes differ, and every decoded element by at most a code step of the map's top
    decade (1/64 of its block's scale): a moment a hair apart may fall in the neighbouring code, and a block
    whose largest element moved by a hair has its scale, so all its elements, moved by a hair."""
    x, y = blockwise.dequantize(a[0], a[1], signed), blockwise.dequantize(b[0], b[1], signed)
    scale = b[1].repeat_interleave(blockwise.BLOCK)[:y.numel()]
    return bool(((x - y).abs() <= scale / 64).all()) and (a[0] != b[0]).float().mean().item() <= 0.01


def _probe(tile: FusedTile, n: int = 4096 + 2 * 256) -> None:
    """Run ``tile`` and :func:`eager_tile` on the same random tile (``n`` elements; bf16: plus an odd length for
    the loop's tail; AdamW at storage offset 0 and Adam with an L2 term past it, two steps each) and raise
    ``RuntimeError`` unless the moments are close (:func:`moments_close`, :func:`int8_moments_close`), the
    parameters within 1e-6 relative plus 1% of the learning rate (a wrong formula moves them by about the
    learning rate), and nothing outside the tile changed."""
    gen = torch.Generator().manual_seed(0)
    n = n + 3 if tile.moments == "bf16" else n
    # at storage offset 0 and past it (the compiler specializes offsets 0 and 1), cut from larger buffers as a
    # step's tiles are: the kernels the step needs most are built and checked here ([Note: compiling once])
    pad = 5 if tile.moments == "bf16" else blockwise.BLOCK
    for decoupled, off in ((True, 0), (False, 7 if tile.moments == "bf16" else blockwise.BLOCK)):
        lr = 1e-3
        group = {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "maximize": False,
                 "decoupled_weight_decay": decoupled}
        size = off + n + pad  # the tile is [off, off + n): elements on both sides must stay as they are
        p = torch.randn(size, generator=gen)
        m32, v32 = torch.randn(size, generator=gen) * 1e-2, torch.rand(size, generator=gen) * 1e-4
        m: Any
        v: Any
        ref: list[Any]
        if tile.moments == "bf16":
            m, v = m32.bfloat16(), v32.bfloat16()
            ref = [p.clone(), m.clone(), v.clone()]
        else:
            m = (torch.empty(size, dtype=torch.uint8), torch.empty(blockwise.n_blocks(size)))
            v = (torch.empty(size, dtype=torch.uint8), torch.empty(blockwise.n_blocks(size)))
            blockwise.quantize(m32, m[0], m[1], True)
            blockwise.quantize(v32, v[0], v[1], False)
            ref = [p.clone(), tuple(t.clone() for t in m), tuple(t.clone() for t in v)]
        keep = [t.clone() if not isinstance(t, tuple) else t[0].clone() for t in (p, m, v)]

        def part(x, off=off):  # the tile (and its blocks' scales)
            if isinstance(x, tuple):
                return x[0][off:off + n], x[1][off // blockwise.BLOCK:(off + n) // blockwise.BLOCK]
            return x[off:off + n]
        for step in (1, 2):
            g = torch.randn(size, generator=gen) * 1e-2
            if tile.moments == "bf16":
                tile(part(p), part(g), part(m), part(v), step_scalars(group, step))
            else:
                tile(part(p), part(g), *part(m), *part(v), step_scalars(group, step))
            eager_tile(part(ref[0]), part(g), part(ref[1]), part(ref[2]), group, step)
        now = [t if not isinstance(t, tuple) else t[0] for t in (p, m, v)]
        if not all(torch.equal(x[:off], y[:off]) and torch.equal(x[off + n:], y[off + n:])
                   for x, y in zip(now, keep, strict=True)):
            raise RuntimeError("the compiled tile wrote outside its tile")
        drift = ((p - ref[0]).abs() - 1e-6 * ref[0].abs()).max().item()
        if tile.moments == "bf16":
            close = [moments_close(m, ref[1]), moments_close(v, ref[2])]
        else:
            close = [int8_moments_close(m, ref[1], True), int8_moments_close(v, ref[2], False)]
        if not all(close) or drift > 0.01 * lr:
            raise RuntimeError(f"the compiled tile disagrees with torch's eager tile on this machine (moments "
                               f"close: {close[0]}/{close[1]}, parameters {drift:.3g} beyond 1e-6 relative)")
