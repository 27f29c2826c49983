"""Block-wise 8-bit quantization of optimizer moments (``"optimizer_state": {"moments": "int8"}``).

The codec of Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022,
arXiv 2110.02861): each block of :data:`BLOCK` elements is scaled by its absolute maximum (kept as one fp32
per block) and each scaled element is stored as the index (a uint8 code) of the nearest value of the
*dynamic* quantization map, whose values span seven decades so that small moments keep a relative
precision. ``exp_avg`` uses the signed map, ``exp_avg_sq`` (never negative) the unsigned one, as torchao's
and bitsandbytes' 8-bit Adam do.

The map and the rounding are torchao's (``torchao.optim.quant_utils``: ``create_dynamic_map`` and
``quantize_8bit_with_qmap``, nearest map value; its ``AdamW8bit`` uses the same maps and blocks of 256), a
well-kept library whose functions run on CPU tensors; torchao is imported on first use, so it is needed only
where int8 moments are configured (the ``int8`` extra).

[Note: the code table]
torchao finds each code by an 8-step branchless binary search over the map: 83 ms per 2M-element tile on
this project's 2-core VM, 41 ms with ``torch.bucketize``, against a tile's whole Adam update of about 25 ms.
Here a scaled value's fp32 bit pattern shifted right by :data:`TABLE_SHIFT` bits (sign, exponent and 11 mantissa
bits) indexes a table of 2^20 codes, each torchao's code for the middle of its bucket: 3.4 ms per tile. A
bucket spans a relative width of 2^-11; only a value within that of the midpoint between two map values can
get the neighbouring code (0.19% of the codes of a normal sample, never off by more than one;
``tests/test_int8_moments.py`` checks both against torchao), so the coding error stays within half a map
step plus 2^-11 relative.

[Note: tiles and blocks]
A block is coded from its own elements only, so a range that starts on a block boundary codes the same as the
whole tensor would: the optimizer's tiles (a multiple of :data:`BLOCK` elements) are quantized one at a time.
The last block of a unit may be short; its scale is the maximum of the elements it has.
"""
from __future__ import annotations

import functools
import logging

import torch

from ..errors import AidaptivConfigError

#: elements per quantization block (torchao's ``AdamW8bit`` default; bitsandbytes uses 256 for its
#: block-wise kernels' smallest size too)
BLOCK = 256
#: bytes of one block's scale (fp32)
SCALE_BYTES = 4


def n_blocks(numel: int) -> int:
    """Blocks (scales) of a moment of ``numel`` elements: ``ceil(numel / BLOCK)``."""
    return -(-int(numel) // BLOCK)


#: bits dropped from a scaled value's fp32 pattern to index the code table ([Note: the code table])
TABLE_SHIFT = 12


def _torchao():
    """torchao's quantization utilities (imported once, its CUDA-kernel warnings silenced on CPU builds).

    Raises:
        AidaptivConfigError: torchao is not installed (int8 moments need the ``int8`` extra).
    """
    try:
        log = logging.getLogger("torchao")
        level = log.level
        log.setLevel(logging.ERROR)  # its import warns about CUDA kernels a CPU build cannot load
        try:
            from torchao.optim import quant_utils
        finally:
            log.setLevel(level)
    except ImportError as e:
        raise AidaptivConfigError(
            "aidaptiv.optimizer_state.moments is \"int8\", which quantizes with torchao's dynamic map, and torchao "
            f"does not import ({e}). Fix: pip install 'aidaptiv_ds[int8]' (torchao), or set \"moments\": \"bf16\""
        ) from e
    return quant_utils


def quantizer_available() -> None:
    """Import torchao now (int8 moments configured), so a missing install is reported before training starts.

    Raises:
        AidaptivConfigError: torchao does not import; the message names the fix.
    """
    _torchao()


@functools.lru_cache(maxsize=2)
def qmap(signed: bool) -> torch.Tensor:
    """The 256 values of the dynamic map, sorted fp32 (``[-1, 1]`` signed, ``[0, 1]`` unsigned)."""
    return torch.tensor(_torchao().create_dynamic_map(signed=signed), dtype=torch.float32)


@functools.lru_cache(maxsize=2)
def code_table(signed: bool) -> torch.Tensor:
    """uint8 ``(2**20,)``: torchao's code of the middle of each bucket of fp32 patterns ([Note: the code table])."""
    mid = (torch.arange(1 << (32 - TABLE_SHIFT), dtype=torch.int64) << TABLE_SHIFT) | (1 << (TABLE_SHIFT - 1))
    vals = mid.to(torch.int32).view(torch.float32)
    vals = torch.nan_to_num(vals, nan=0.0, posinf=1.0, neginf=-1.0).clamp(-1.0 if signed else 0.0, 1.0)
    return _torchao().quantize_8bit_with_qmap(vals, qmap(signed))


def _codes(scaled: torch.Tensor, signed: bool, out: torch.Tensor | None = None,
           overwrite: bool = False) -> torch.Tensor:
    """uint8 codes of fp32 values in the map's range (shape kept), into ``out`` (uint8, contiguous, same
    numel) when given; ``overwrite``: ``scaled`` (contiguous) is scratch, its bits become the table indices."""
    bits = scaled.contiguous().view(torch.int32)
    idx = bits.bitwise_right_shift_(TABLE_SHIFT) if overwrite else torch.bitwise_right_shift(bits, TABLE_SHIFT)
    idx.bitwise_and_((1 << (32 - TABLE_SHIFT)) - 1)
    if out is None:
        return torch.index_select(code_table(signed), 0, idx.view(-1)).view(scaled.shape)
    return torch.index_select(code_table(signed), 0, idx.view(-1), out=out.view(-1))


def quantize(src: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, signed: bool,
             overwrite: bool = False) -> None:
    """Code ``src`` into ``codes`` and ``scales`` in place.

    Args:
        src: fp32 values, shape ``(n,)``, starting on a block boundary of the unit ([Note: tiles and blocks]).
        codes: uint8, shape ``(n,)``: the map index of each scaled element.
        scales: fp32, shape ``(n_blocks(n),)``: each block's absolute maximum (clipped to >= 1e-12, as torchao).
        signed: the signed map (``exp_avg``) or the unsigned one (``exp_avg_sq``, values >= 0).
        overwrite: ``src`` (contiguous) is the caller's scratch and may be overwritten: the scaling and the
            table indices are computed in its memory instead of two new tensors of its size (the same codes and
            scales, bit for bit; the tiled step's tile, ``integration/host_step.py``).
    """
    n = src.numel()
    full = n - n % BLOCK
    if full:
        blocks = src[:full].view(-1, BLOCK)
        s = torch.maximum(blocks.amax(-1), blocks.amin(-1).neg_()).clip_(1e-12)  # |x| max, no |x| tensor
        scales[:full // BLOCK].copy_(s)
        if overwrite and src.is_contiguous():
            _codes(blocks.div_(s.view(-1, 1)).view(-1), signed, out=codes[:full], overwrite=True)
        else:
            _codes((blocks / s.view(-1, 1)).view(-1), signed, out=codes[:full])
    if full < n:  # the unit's short last block
        tail = src[full:]
        s = tail.abs().amax().clip(1e-12)
        scales[-1] = s
        codes[full:].copy_(_codes(tail / s, signed))


def dequantize(codes: torch.Tensor, scales: torch.Tensor, signed: bool, out: torch.Tensor | None = None,
               index: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of ``codes`` (uint8, ``(n,)``) with their blocks' ``scales`` (fp32,
    ``(n_blocks(n),)``): ``qmap[code] * scale`` (torchao's ``dequant_with_qmap``), into ``out`` (fp32
    ``(n,)``) when given; returns the values. ``index``: int32 scratch of >= ``n`` elements for the map indices
    (the tiled step's, reused by every tile: a fresh index tensor per tile is fresh pages when no heap is kept)."""
    n = codes.numel()
    out = torch.empty(n, dtype=torch.float32) if out is None else out
    idx = codes.to(torch.int32) if index is None else index[:n].copy_(codes)
    torch.index_select(qmap(signed), 0, idx, out=out)
    full = n - n % BLOCK
    if full:
        out[:full].view(-1, BLOCK).mul_(scales[:full // BLOCK].view(-1, 1))
    if full < n:
        out[full:].mul_(scales[-1])
    return out
