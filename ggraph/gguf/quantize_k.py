"""Searched quantisers: the k-quants, IQ4_NL/IQ4_XS and importance-weighted Q4_0..Q5_1, as ggml makes them.

``quants.py`` quantises the formats whose scale follows from a block's extremes. The ones
here *search* for it: they try a row of candidate scales, keep the one with the least
weighted error, then store the winning per-group scales themselves as small integers
under one fp16 super-scale. Each search is one function named after the ggml routine it
reproduces (``_qx_search`` is ``make_qx_quants``, and so on), and each format is a short
function that calls them and packs bytes, so that ``quantize_rows(x, dtype, imatrix)``
gives the bytes of ggml's ``ggml_quantize_chunk(type, x, dst, 0, rows, n_per_row, imatrix)``.

Layout: a search works on **groups as columns**. ``x`` is ``(k, m)``: m groups of k
elements (k = 16 or 32, or the 8/16 sub-scales of a super-block), element i of every
group in row i. Per-group values (scales, mins, sums) are ``(m,)`` and broadcast along
the rows. Python loops only where C loops inside a group: over the candidate scales,
and over the k rows of a sum or a sequential refinement.

Bit-exactness rules, followed everywhere:

- All arithmetic is float32 in C's evaluation order (``w*x*l`` is ``(w*x)*l``); ggml-base
  is built without FMA, so numpy float32 reproduces it operation by operation.
- A sum over a group is sequential in C, so it is ``_seq_sum`` (row by row), never
  ``np.sum``, which adds pairwise.
- ``nearest_int`` is ggml's ``1.5*2**23`` trick (``_nearest_int``), kept even where it
  gives garbage (|v| >= 2**22, inf, NaN), because C keeps it too; ``(uint8_t)`` and
  ``(int8_t)`` stores wrap, as numpy's ``astype`` does.
- "The first largest" (C's ``if (v > best) best = v``) mirrors the C loop, so ties,
  signed zeros and NaNs (whose comparisons are false) come out as C's do.

Without an imatrix each type runs ggml's ``quantize_row_*_ref`` (weights taken from the
data itself); with one it runs ``quantize_row_*_impl``, whose weights are
``imatrix * sqrt(sigma2 + x*x)``, sigma2 being the mean square of the super-block (of the
whole row for the legacy types). IQ4_NL and IQ4_XS take one path either way, as
``quantize_iq4_nl`` / ``quantize_iq4_xs`` do.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ggraph.gguf.block_bits import IQ4_VALUES, k_scale_min, pack_bit4_u32, pack_nibbles, q3_k_scales
from ggraph.ir import dtypes
from ggraph.ir.dtypes import DType

F32 = np.float32
_EPS = F32(1e-15)            # ggml's GROUP_MAX_EPS: a group whose |x| stays below it is all zero


# ---------------------------------------------------------------- C arithmetic in numpy

def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: add 1.5*2**23, keep the low 23 mantissa bits (rounds halves to even)."""
    bits = (np.asarray(v, F32) + F32(12582912)).view(np.int32)
    bits &= 0x7FFFFF
    bits -= 0x400000
    return bits


def _levels(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``MAX(lo, MIN(hi, nearest_int(v)))`` as float32 (small integers, exact)."""
    return np.clip(_nearest_int(v), lo, hi).astype(F32)


def _seq_sum(t: np.ndarray, from_zero: bool = True) -> np.ndarray:
    """(k, m) -> (m,): C's ``s = 0; for (i) s += t[i]`` in float32, row after row.

    With ``from_zero=False`` the C loop starts from ``s = t[0]``; the two differ only in
    the sign of an all-zero sum (0 + -0 is +0).
    """
    s = t[0] + F32(0) if from_zero else t[0].copy()
    for row in t[1:]:
        s += row
    return s


def _running_pick(x: np.ndarray, better: Callable, start: np.ndarray | None = None) -> np.ndarray:
    """(k, m) -> (m,): C's ``for (i) if (better(x[i], best)) best = x[i]``.

    ``start`` is the initial best; without it the loop starts from ``best = x[0]``.
    """
    best = x[0] if start is None else start
    for row in x[1:] if start is None else x:
        best = np.where(better(row, best), row, best)
    return best


def _c_min(x: np.ndarray) -> np.ndarray:
    """``min = x[0]; if (x[i] < min) min = x[i]``."""
    return _running_pick(x, np.less)


def _c_max(x: np.ndarray) -> np.ndarray:
    """``max = x[0]; if (x[i] > max) max = x[i]``."""
    return _running_pick(x, np.greater)


def _c_max_from_zero(x: np.ndarray) -> np.ndarray:
    """``max = 0; if (x[i] > max) max = x[i]``: the largest positive value, else +0."""
    return _running_pick(x, np.greater, np.zeros(x.shape[1], F32))


def _c_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(k, m) -> amax, max (m,): ``amax = max = 0; if (fabsf(v) > amax) { amax = fabsf(v); max = v; }``.

    max is the first value of largest magnitude, with its sign; +0 for an all-zero group.
    """
    amax = np.zeros(x.shape[1], F32)
    mx = np.zeros(x.shape[1], F32)
    for row in x:
        a = np.abs(row)
        take = a > amax
        amax = np.where(take, a, amax)
        mx = np.where(take, row, mx)
    return amax, mx


def _f16_round(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 (m,) -> bytes (m, 2) and the value read back: ggml's FP32_TO_FP16 (nearest even) and back."""
    h = np.asarray(v, F32).astype(np.float16).reshape(-1, 1)
    return h.view(np.uint8), h.astype(F32)[:, 0]


def _groups(x: np.ndarray, size: int) -> np.ndarray:
    """(n, block) -> (size, n*block/size): consecutive runs of ``size`` elements as columns."""
    return np.ascontiguousarray(x.reshape(-1, size).T)


def _ungroup(L: np.ndarray, n: int) -> np.ndarray:
    """(size, m) -> (n, m*size/n): the inverse of ``_groups``."""
    return L.T.reshape(n, -1)


# ---------------------------------------------------------------- scale searches (ggml's make_*_quants)

def _qx_search(x: np.ndarray, nmax: int, w: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``make_qx_quants`` (rmse_type 1): symmetric levels l in [-nmax, nmax), x ~ scale*l.

    Tries iscale = -(nmax + 0.1*k)/max for k = 0, then -9..9, and keeps the first that
    most raises sum(w*x*l)^2/sum(w*l*l) (the weighted squared error it removes); the scale
    is the least-squares sum(w*x*l)/sum(w*l*l). ``w`` defaults to x*x. Returns scale (m,)
    and L = l + nmax (k, m) uint8; an all-zero group gives 0 and 0.
    """
    w = x * x if w is None else w
    wx = w * x
    amax, mx = _c_absmax(x)

    def fit(iscale):
        l = _levels(iscale * x, -nmax, nmax - 1)
        return _seq_sum(wx * l), _seq_sum(w * l * l)

    iscale = F32(-nmax) / mx
    sumlx, suml2 = fit(iscale)
    scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    for k in range(-9, 10):
        if k == 0:
            continue
        iscale_k = -(F32(nmax) + F32(0.1) * F32(k)) / mx
        slx, sl2 = fit(iscale_k)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        iscale = np.where(better, iscale_k, iscale)
        scale = np.where(better, slx / sl2, scale)
        best = np.where(better, scale * slx, best)
    L = _levels(iscale * x, -nmax, nmax - 1) + F32(nmax)              # the winner's levels, as C keeps them
    zero = amax < _EPS
    return np.where(zero, F32(0), scale), np.where(zero, F32(0), L).astype(np.uint8)


def _q3_search(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``make_q3_quants(nmax=4, do_rmse)``: levels in [-4, 4) from -4/max, then up to 5
    passes that, element by element, move a level to its least-squares value while that
    raises sum(w*x*l)^2/sum(w*l*l), with w = x*x. Returns scale (m,), L = l + 4 (k, m) uint8."""
    nmax = 4
    amax, mx = _c_absmax(x)
    w = x * x
    wx = w * x
    L = _levels((F32(-nmax) / mx) * x, -nmax, nmax - 1)
    sumlx, suml2 = _seq_sum(wx * L), _seq_sum(w * L * L)
    for _ in range(5):
        changed = False
        for i in range(x.shape[0]):
            li = L[i]
            slx = sumlx - wx[i] * li
            sl2 = suml2 - w[i] * li * li
            new = _levels(x[i] * sl2 / slx, -nmax, nmax - 1)
            slx_new = slx + wx[i] * new
            sl2_new = sl2 + w[i] * new * new
            take = ((slx > 0) & (new != li) & (sl2_new > 0)
                    & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new))
            L[i] = np.where(take, new, li)
            sumlx = np.where(take, slx_new, sumlx)
            suml2 = np.where(take, sl2_new, suml2)
            changed = changed or bool(take.any())
        if not changed:                      # a pass that moved nothing leaves nothing for the next
            break
    zero = amax < _EPS
    scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    return np.where(zero, F32(0), scale), np.where(zero, F32(0), L + F32(nmax)).astype(np.uint8)


def _qp_search(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``make_qp_quants``: the non-negative sub-scales x of a super-block as levels in [0, nmax].

    Picks iscale = (nmax + 0.1*k)/max, k in -4..4, by least weighted squared error, then
    refines level by level as ``_q3_search`` does. Returns scale (m,) and L (k, m) uint8.
    """
    mx = _running_pick(x, lambda v, best: ~(best > v), np.zeros(x.shape[1], F32))   # C's MAX(max, x[i])
    iscale = F32(nmax) / mx
    L0 = _nearest_int(iscale * x).astype(np.uint8).astype(F32)         # stored unclipped into uint8
    diff = x - (F32(1) / iscale) * L0
    best = _seq_sum(w * diff * diff)
    for k in range(-4, 5):
        if k == 0:
            continue
        iscale_k = (F32(0.1) * F32(k) + F32(nmax)) / mx
        lk = np.minimum(_nearest_int(iscale_k * x), nmax).astype(F32)
        diff = x - (F32(1) / iscale_k) * lk
        mse = _seq_sum(w * diff * diff)
        better = mse < best
        best = np.where(better, mse, best)
        iscale = np.where(better, iscale_k, iscale)
    l = np.minimum(_nearest_int(iscale * x), nmax)
    wx = w * x
    lf = l.astype(F32)
    sumlx, suml2 = _seq_sum(wx * lf), _seq_sum(w * lf * lf)
    L = l.astype(np.uint8)
    for _ in range(5):
        changed = False
        for i in range(x.shape[0]):
            li = L[i].astype(F32)
            slx = sumlx - wx[i] * li
            sl2 = suml2 - w[i] * li * li
            new = np.minimum(_nearest_int(x[i] * sl2 / slx), nmax)
            nf = new.astype(F32)
            slx_new = slx + wx[i] * nf
            sl2_new = sl2 + w[i] * nf * nf
            take = ((slx > 0) & (sl2 > 0) & (new != L[i])
                    & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new))
            L[i] = np.where(take, new.astype(np.uint8), L[i])
            sumlx = np.where(take, slx_new, sumlx)
            suml2 = np.where(take, sl2_new, suml2)
            changed = changed or bool(take.any())
        if not changed:
            break
    zero = mx < _EPS
    scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    return np.where(zero, F32(0), scale), np.where(zero, np.uint8(0), L)


def _affine_search(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
                   use_mad: bool, flat_if_le: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``make_qkx2_quants`` / ``make_qkx3_quants``: x ~ scale*l + min, l in [0, nmax], min <= 0.

    Starts from the range [min(x, 0), max(x)]; then for iscale = (nmax + rmin + rdelta*k)/(max - min),
    k = 0..nstep, rounds, fits scale and min by weighted least squares (min clamped to 0
    if it comes out positive), and keeps the fit with the least weighted error (|diff| if
    ``use_mad`` else diff^2). Each candidate rounds against the best min so far, as C's
    loop does. qkx3 (``flat_if_le``) calls max <= min a flat group, qkx2 only max == min.
    Returns scale, the_min = -min (m,), and L (k, m) uint8.
    """
    mn, mx = _c_min(x), _c_max(x)
    sum_w = _seq_sum(w, from_zero=False)
    sum_x = _seq_sum(w * x, from_zero=False)
    mn = np.where(mn > 0, F32(0), mn)
    flat = (mx <= mn) if flat_if_le else (mx == mn)

    def levels(iscale, mins):
        return _levels(iscale * (x - mins), 0, nmax)

    def error(scale, mins, l):
        diff = scale * l + mins - x
        return _seq_sum(w * (np.abs(diff) if use_mad else diff * diff))

    iscale = F32(nmax) / (mx - mn)
    scale = F32(1) / iscale
    best = error(scale, mn, levels(iscale, mn))
    win_iscale, win_min = iscale, mn                                   # the rounding behind the best levels
    for k in range(nstep + 1):
        iscale = (F32(rmin) + F32(rdelta) * F32(k) + F32(nmax)) / (mx - mn)
        l = levels(iscale, mn)
        wl = w * l
        sum_l, sum_l2, sum_xl = _seq_sum(wl), _seq_sum(wl * l), _seq_sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        positive = this_min > 0
        this_min = np.where(positive, F32(0), this_min)
        this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        cur = error(this_scale, this_min, l)
        take = (D > 0) & (cur < best) & ~flat                          # C returns before the loop if flat
        win_iscale = np.where(take, iscale, win_iscale)
        win_min = np.where(take, mn, win_min)
        best = np.where(take, cur, best)
        scale = np.where(take, this_scale, scale)
        mn = np.where(take, this_min, mn)
    L = np.where(flat, F32(0), levels(win_iscale, win_min)).astype(np.uint8)
    return np.where(flat, F32(0), scale), -mn, L


# _IQ4_INDEX[t + 256] = the index of the IQ4 level nearest to any v with floor(2v) = t
_IQ4_MIDS2 = (IQ4_VALUES[:-1] + IQ4_VALUES[1:]).astype(np.int32)      # twice the midpoints, integers
_IQ4_INDEX = (np.arange(-256, 228)[:, None] >= _IQ4_MIDS2).sum(axis=1).astype(np.uint8)


def _best_iq4(v: np.ndarray) -> np.ndarray:
    """``best_index_int8`` over IQ4_VALUES: the index of the nearest level, the upper one on a tie.

    C tests ``v - lo < hi - v``; near a midpoint both sides are exact in float32, so this
    is ``v < (lo + hi)/2``, and as the midpoints are multiples of 1/2 it only needs
    floor(2v): a table lookup. NaN goes to the top level, as C's binary search sends it.
    """
    t = np.floor(np.maximum(np.fmin(v, F32(113)), F32(-128)) * F32(2)).astype(np.int32)
    return _IQ4_INDEX[t + 256]


def _iq4_search(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The per-block search of ``quantize_row_iq4_nl_impl`` (with ntry = 7): d in x ~ d*IQ4_VALUES[q].

    Starts from d = max/127 (the extreme on the -127 level), then tries
    1/d = (k - 127)/max for k = -7..7, keeping the least-squares d with the largest
    sum(w*q*x)^2/sum(w*q*q). Returns d (m,); all-zero groups give 0.
    """
    amax, mx = _c_absmax(x)

    def fit(inv):
        q = IQ4_VALUES[_best_iq4(inv * x)]
        wq = w * q
        return _seq_sum(wq * x), _seq_sum(wq * q)

    sumqx, sumq2 = fit(F32(1) / (-mx / IQ4_VALUES[0]))
    d = np.where(sumq2 > 0, sumqx / sumq2, F32(0))
    best = d * sumqx
    for k in range(-7, 8):
        sumqx, sumq2 = fit((F32(k) + IQ4_VALUES[0]) / mx)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(better, sumqx / sumq2, d)
        best = np.where(better, d * sumqx, best)
    return np.where(amax < _EPS, F32(0), d)


# ---------------------------------------------------------------- steps the formats share

def _sigma2(x: np.ndarray, factor: int) -> np.ndarray:
    """(n, k) -> (n,): ``factor*sum(x*x)/k`` in C's order: the sigma2 of the ``_impl`` weights."""
    return F32(factor) * _seq_sum(np.ascontiguousarray((x * x).T)) / F32(x.shape[1])


def _imatrix_weights(x: np.ndarray, qw: np.ndarray, sigma2: np.ndarray) -> np.ndarray:
    """``qw * sqrt(sigma2 + x*x)``: the importance of each element, as every ``_impl`` forms it."""
    return qw * np.sqrt(sigma2 + x * x)


def _requantize(x: np.ndarray, d: np.ndarray, dm: np.ndarray | None, lo: int, hi: int,
                L: np.ndarray) -> np.ndarray:
    """Round each group again against its *stored* scale: clip(rint((x + dm)/d), lo, hi) - lo.

    x (k, m); d, dm (m,) the decoded group scale and min (dm None for symmetric formats).
    Groups whose d is 0 keep the search's levels ``L``, as C's ``if (!d) continue`` does.
    """
    num = x if dm is None else x + dm
    l = (_levels(num / d, lo, hi) - F32(lo)).astype(np.uint8)
    return np.where(d == 0, L, l)


def _pack_crumbs(L: np.ndarray) -> np.ndarray:
    """(n, 256) 2-bit values -> (n, 64): per 128 elements, byte l holds l, l+32, l+64, l+96 at shifts 0-6."""
    q = L.reshape(L.shape[0], 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _pack_nibble_groups(L: np.ndarray, group: int) -> np.ndarray:
    """(n, k*2*group) 4-bit values -> (n, k*group): in each 2*group, the first group low, the next high."""
    q = L.reshape(L.shape[0], -1, 2, group)
    return ((q[:, :, 0] & 15) | (q[:, :, 1] << 4)).reshape(L.shape[0], -1)


def _pack_bit_planes(bits: np.ndarray) -> np.ndarray:
    """(n, 256) 0/1 -> (n, 32): element i is bit i//32 of byte i%32 (the high bits of Q3_K, Q5_K)."""
    b = bits.reshape(bits.shape[0], 8, 32).astype(np.uint8)
    return np.bitwise_or.reduce(b << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)


def _pack_k_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """(n, 8) 6-bit scales and mins -> the 12 scale bytes of Q4_K/Q5_K (inverse of ``k_scale_min``)."""
    a = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    b = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    c = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    return np.concatenate([a, b, c], axis=1)


def _pack_q3_scales(l: np.ndarray) -> np.ndarray:
    """(n, 16) 6-bit values -> the 12 scale bytes of Q3_K (inverse of ``q3_k_scales``)."""
    low = (l[:, :8] & 15) | ((l[:, 8:] & 15) << 4)
    high = (l >> 4).reshape(-1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[None, :, None]
    return np.concatenate([low, np.bitwise_or.reduce(high, axis=1)], axis=1)


def _scale_levels(v: np.ndarray, top: np.ndarray, levels: int) -> np.ndarray:
    """(8|16, n) sub-scales -> (n, 8|16) uint8 ``nearest_int(v * levels/top)``, 0 where top <= 0."""
    inv = np.where(top > 0, F32(levels) / top, F32(0))
    return _nearest_int(inv * v).astype(np.uint8).T


# ---------------------------------------------------------------- Q2_K, Q4_K, Q5_K: a scale and a min per group

def _q2_k(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """(n, 256) -> (n, 84): 16 groups of 16 with 2-bit levels and a 4-bit scale and min each."""
    n = x.shape[0]
    g = _groups(x, 16)                                                 # (16, 16n)
    if qw is None:
        sc, mn, L = _affine_search(g, np.abs(g), 3, -0.5, 0.1, 15, use_mad=True, flat_if_le=False)
        sc, mn = sc.reshape(n, 16).T, mn.reshape(n, 16).T              # (16, n)
        max_sc, max_mn = _c_max_from_zero(sc), _c_max_from_zero(mn)
        ls, lm = _scale_levels(sc, max_sc, 15), _scale_levels(mn, max_mn, 15)
        d = np.where(max_sc > 0, max_sc / F32(15), F32(0))
        dmin = np.where(max_mn > 0, max_mn / F32(15), F32(0))
    else:
        w = _groups(_imatrix_weights(x, qw, _sigma2(x, 1)[:, None]), 16)
        sc, mn, L = _affine_search(g, w, 3, -0.9, 0.05, 36, use_mad=False, flat_if_le=True)
        sw = _seq_sum(w).reshape(n, 16).T
        d, ls = _qp_search(sc.reshape(n, 16).T, 15, sw)
        dmin, lm = _qp_search(mn.reshape(n, 16).T, 15, sw)
        ls, lm = ls.T, lm.T
    scales = ls | (lm << 4)                                            # (n, 16)
    d16, d = _f16_round(d)
    m16, dmin = _f16_round(dmin)
    dl = (d[:, None] * (scales & 15)).reshape(-1)
    ml = (dmin[:, None] * (scales >> 4)).reshape(-1)
    L = _ungroup(_requantize(g, dl, ml, 0, 3, L), n)
    return np.concatenate([scales, _pack_crumbs(L), d16, m16], axis=1)


def _q45_k(x: np.ndarray, qw: np.ndarray | None, nmax: int, rmin: float, nstep: int) -> tuple:
    """What Q4_K and Q5_K share: 8 groups of 32, each with a 6-bit scale and min.

    Returns (d and dmin bytes (n, 4), the 12 scale bytes (n, 12), levels (n, 256) in [0, nmax]).
    """
    n = x.shape[0]
    g = _groups(x, 32)                                                 # (32, 8n)
    if qw is None:
        av = np.sqrt(_seq_sum(g * g) / F32(32))
        sc, mn, L = _affine_search(g, av + np.abs(g), nmax, rmin, 0.1, nstep, use_mad=False, flat_if_le=False)
        sc, mn = sc.reshape(n, 8).T, mn.reshape(n, 8).T                # (8, n)
        max_sc, max_mn = _c_max_from_zero(sc), _c_max_from_zero(mn)
        ls = np.minimum(_scale_levels(sc, max_sc, 63), 63)
        lm = np.minimum(_scale_levels(mn, max_mn, 63), 63)
        d, dmin = max_sc / F32(63), max_mn / F32(63)
    else:
        w = _groups(_imatrix_weights(x, qw, _sigma2(x, 2)[:, None]), 32)
        sc, mn, L = _affine_search(g, w, nmax, -0.9, 0.05, 36, use_mad=False, flat_if_le=True)
        sw = _seq_sum(w).reshape(n, 8).T
        d, ls = _qp_search(sc.reshape(n, 8).T, 63, sw)
        dmin, lm = _qp_search(mn.reshape(n, 8).T, 63, sw)
        ls, lm = ls.T, lm.T
        if nmax == 31:                                                 # Q5_K's _impl clamps them, Q4_K's not
            ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
    packed = _pack_k_scales(ls, lm)
    d16, d = _f16_round(d)
    m16, dmin = _f16_round(dmin)
    sc6, m6 = k_scale_min(packed)                                      # read back, as the C code does
    dl = (d[:, None] * sc6).reshape(-1)
    ml = (dmin[:, None] * m6).reshape(-1)
    L = _ungroup(_requantize(g, dl, ml, 0, nmax, L), n)
    return np.concatenate([d16, m16], axis=1), packed, L


def _q4_k(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """(n, 256) -> (n, 144): d, dmin, 12 scale bytes, 4-bit levels (nibbles per 64)."""
    dm, scales, L = _q45_k(x, qw, 15, -1.0, 20)
    return np.concatenate([dm, scales, _pack_nibble_groups(L, 32)], axis=1)


def _q5_k(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """(n, 256) -> (n, 176): as Q4_K, with bit 4 of each level in qh."""
    dm, scales, L = _q45_k(x, qw, 31, -0.5, 15)
    return np.concatenate([dm, scales, _pack_bit_planes(L >> 4), _pack_nibble_groups(L & 15, 32)], axis=1)


# ---------------------------------------------------------------- Q3_K, Q6_K: one signed scale per group of 16

def _q3_k(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """(n, 256) -> (n, 110): 3-bit levels (2 bits in qs, 1 in hmask) and 6-bit signed group scales."""
    n = x.shape[0]
    g = _groups(x, 16)                                                 # (16, 16n)
    if qw is None:
        sc, L = _q3_search(g)
        sc = sc.reshape(n, 16).T                                       # (16, n)
        _, max_sc = _c_absmax(sc)
        iscale = F32(-32) / max_sc
        l = _nearest_int(iscale * sc).astype(np.int8).astype(np.int32)   # C stores it in an int8_t
        l = np.where(max_sc != 0, np.clip(l, -32, 31) + 32, 0).T.astype(np.uint8)
        d = np.where(max_sc != 0, F32(1) / iscale, F32(0))
    else:
        w = _groups(_imatrix_weights(x, qw, _sigma2(x, 2)[:, None]), 16)
        sc, L = _qx_search(g, 4, w)
        d, l = _qx_search(sc.reshape(n, 16).T, 32, _seq_sum(w).reshape(n, 16).T)
        l = l.T
    scales = _pack_q3_scales(l)
    d16, d = _f16_round(d)
    dl = (d[:, None] * q3_k_scales(scales)).reshape(-1)
    L = _ungroup(_requantize(g, dl, None, -4, 3, L), n)
    return np.concatenate([_pack_bit_planes(L >> 2), _pack_crumbs(L & 3), scales, d16], axis=1)


def _q6_k(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """(n, 256) -> (n, 210): 6-bit levels (4 bits in ql, 2 in qh), int8 group scales; the imatrix as is."""
    n = x.shape[0]
    g = _groups(x, 16)                                                 # (16, 16n)
    sc, L = _qx_search(g, 32, None if qw is None else _groups(qw, 16))
    sc = sc.reshape(n, 16).T                                           # (16, n)
    amax, max_sc = _c_absmax(sc)
    iscale = F32(-128) / max_sc
    scales = np.minimum(_nearest_int(iscale * sc), 127).astype(np.int8).T          # (n, 16)
    d16, d = _f16_round(F32(1) / iscale)
    dl = (d[:, None] * scales).reshape(-1)
    L = _ungroup(_requantize(g, dl, None, -32, 31, L), n)
    out = np.concatenate([_pack_nibble_groups(L & 15, 64), _pack_crumbs(L >> 4),
                          scales.view(np.uint8), d16], axis=1)
    out[amax < _EPS] = 0                                               # an all-zero block is all zero bytes
    return out


# ---------------------------------------------------------------- IQ4_NL, IQ4_XS: non-linear levels

def _iq4_weights(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """(n, block) weights of ``quantize_row_iq4_nl_impl``: x*x, or qw*sqrt(sigma2 + x*x), sigma2 = 2*mean(x*x)."""
    if qw is None:
        return x * x
    sigma2 = _seq_sum(np.ascontiguousarray((x * x).T)) * (F32(2) / F32(x.shape[1]))
    return _imatrix_weights(x, qw, sigma2[:, None])


def _iq4_nl(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """(n, 32) -> (n, 18): d fp16, then each x/d's nearest IQ4 level, 16 low and 16 high nibbles."""
    g = _groups(x, 32)                                                 # (32, n)
    d = _iq4_search(g, _groups(_iq4_weights(x, qw), 32))
    inv = np.where(d != 0, F32(1) / d, F32(0))
    return np.concatenate([_f16_round(d)[0], pack_nibbles(_best_iq4(inv * g).T)], axis=1)


def _iq4_xs(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """(n, 256) -> (n, 136): 8 groups of 32 with 6-bit signed scales under one fp16 d."""
    n = x.shape[0]
    g = _groups(x, 32)                                                 # (32, 8n)
    sc = _iq4_search(g, _groups(_iq4_weights(x, qw), 32)).reshape(n, 8).T          # (8, n)
    _, max_sc = _c_absmax(sc)
    d = -max_sc / F32(32)
    inv = np.where(d != 0, F32(1) / d, F32(0))
    l = np.clip(_nearest_int(inv * sc), -32, 31)                      # (8, n)
    dl = (d * l.astype(F32)).T.reshape(-1)                             # (8n,)
    idl = np.where(dl != 0, F32(1) / dl, F32(0))
    q = _ungroup(_best_iq4(idl * g), n)                                # (n, 256)
    l = (l.T + 32).astype(np.uint16)                                   # (n, 8)
    scales_l = ((l[:, 0::2] & 15) | ((l[:, 1::2] & 15) << 4)).astype(np.uint8)
    scales_h = np.bitwise_or.reduce((l >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1)
    return np.concatenate([_f16_round(d)[0], scales_h[:, None].view(np.uint8), scales_l,
                           _pack_nibble_groups(q, 16)], axis=1)


# ---------------------------------------------------------------- Q4_0 .. Q5_1 with an imatrix

def _q4_0_w(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(n, 32) -> (n, 18): d from ``_qx_search`` (levels in [-8, 8)) instead of max/-8."""
    d, L = _qx_search(_groups(x, 32), 8, _groups(w, 32))
    return np.concatenate([_f16_round(d)[0], pack_nibbles(L.T)], axis=1)


def _q5_0_w(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(n, 32) -> (n, 22): d from ``_qx_search`` (levels in [-16, 16))."""
    d, L = _qx_search(_groups(x, 32), 16, _groups(w, 32))
    L = L.T
    return np.concatenate([_f16_round(d)[0], pack_bit4_u32(L), pack_nibbles(L & 15)], axis=1)


def _q4_1_w(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(n, 32) -> (n, 20): d and m from ``_affine_search`` (levels in [0, 15])."""
    d, the_min, L = _affine_search(_groups(x, 32), _groups(w, 32), 15, -0.9, 0.05, 36,
                                   use_mad=False, flat_if_le=True)
    return np.concatenate([_f16_round(d)[0], _f16_round(-the_min)[0], pack_nibbles(L.T)], axis=1)


def _q5_1_w(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(n, 32) -> (n, 24): d and m from ``_affine_search`` (levels in [0, 31])."""
    d, the_min, L = _affine_search(_groups(x, 32), _groups(w, 32), 31, -0.9, 0.05, 36,
                                   use_mad=False, flat_if_le=True)
    L = L.T
    return np.concatenate([_f16_round(d)[0], _f16_round(-the_min)[0], pack_bit4_u32(L),
                           pack_nibbles(L & 15)], axis=1)


# ---------------------------------------------------------------- tables and the row driver

# fn(blocks (n, block_size) float32, their imatrix slices (n, block_size) or None) -> (n, type_size) uint8
SEARCHED: dict[DType, Callable] = {
    dtypes.q2_k: _q2_k, dtypes.q3_k: _q3_k, dtypes.q4_k: _q4_k, dtypes.q5_k: _q5_k,
    dtypes.q6_k: _q6_k, dtypes.iq4_nl: _iq4_nl, dtypes.iq4_xs: _iq4_xs,
}

# fn(blocks, element weights (n, block_size)) -> bytes: the legacy types when an imatrix is given
WEIGHTED_LEGACY: dict[DType, Callable] = {
    dtypes.q4_0: _q4_0_w, dtypes.q4_1: _q4_1_w, dtypes.q5_0: _q5_0_w, dtypes.q5_1: _q5_1_w,
}


# elements per step: the searches loop in Python over candidates and a block's elements, so a step
# must be wide enough to hide that loop's overhead, yet keep its temporaries in L2 (docs/performance.md)
_CHUNK = 1 << 17


def _row_sigma2(x: np.ndarray) -> np.ndarray:
    """(rows, n_per_row) -> (rows,): sum(x*x)/n_per_row of each whole row, a few rows at a time."""
    step = max(1, _CHUNK // x.shape[1])
    return np.concatenate([_sigma2(x[i:i + step], 1) for i in range(0, x.shape[0], step)])


def quantize_rows(x: np.ndarray, dt: DType, imatrix: np.ndarray | None) -> np.ndarray:
    """(rows, n_per_row) float32 -> (rows, row_bytes) uint8, as ``ggml_quantize_chunk``.

    ``dt`` is a key of SEARCHED, or of WEIGHTED_LEGACY when an imatrix is given;
    ``imatrix`` is a checked float32 vector of n_per_row weights that every row shares.
    Blocks go through in chunks of about _CHUNK elements so that a step's temporaries
    stay in cache.
    """
    rows, n_per_row = x.shape
    if x.size == 0:
        return np.zeros((rows, dt.row_bytes(n_per_row)), np.uint8)
    bs = dt.block_size
    per_row = n_per_row // bs
    blocks = x.reshape(-1, bs)                                         # (rows * per_row, bs)
    out = np.empty((blocks.shape[0], dt.type_size), np.uint8)
    qw = None if imatrix is None else imatrix.reshape(per_row, bs)
    legacy = dt in WEIGHTED_LEGACY
    fn = WEIGHTED_LEGACY[dt] if legacy else SEARCHED[dt]
    step = max(1, _CHUNK // bs)
    with np.errstate(all="ignore"):                                    # C divides by zero and carries on
        sigma2 = _row_sigma2(x) if legacy else None                   # the legacy _impls use the whole row's
        for i in range(0, blocks.shape[0], step):
            xb = blocks[i:i + step]
            index = np.arange(i, i + xb.shape[0])
            w = None if qw is None else qw[index % per_row]
            if legacy:
                w = _imatrix_weights(xb, w, sigma2[index // per_row][:, None])
            out[i:i + step] = fn(xb, w)
    return out.reshape(rows, dt.row_bytes(n_per_row))
