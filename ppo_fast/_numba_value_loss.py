"""The numba clipped value loss: the loss, its exact gradient and the clipped count in one pass
over rows (twin of ``_reference.py``'s; the Cython twin is in ``src/rows_loss.h``). Registered as
the backend's kernel in ``_numba_kernels.py``; conventions in ``_numba_core.py``, and, as the
policy losses (``_numba_losses.py``), it runs in lanes (``_numba_lanes``), operation for
operation its C twin's, and gives its bits.
"""

from __future__ import annotations

import numpy as np

from ._numba_core import _without_refcounts
from ._numba_lanes import (
    _count_valid_lanes,
    _lane_total,
    _lanes_add,
    _lanes_clip,
    _lanes_f64,
    _lanes_gt,
    _lanes_mul,
    _lanes_of,
    _lanes_put,
    _lanes_put_first,
    _lanes_splat,
    _lanes_sub,
    _lanes_where,
    _tail_fill,
    _valid_all,
    _valid_and,
    _valid_and_not,
    _valid_bytes,
    _valid_first,
)
from ._numba_losses import _CHUNK
from ._numba_memory import _stack_array


@_without_refcounts
def _value_block(valid, values, old_values, returns, i, clip_range, scale, zero, grad, loss):
    """Twin: src/rows_loss.h ppo_value_block. The 8 positions from i, ``valid`` as the mask and
    the length allow: stores their gradient, returns the loss lanes with their halved squares
    added, and how many of them were clipped."""
    value = _lanes_of(values, i)
    old = _lanes_of(old_values, i)
    target = _lanes_of(returns, i)
    error = _lanes_sub(value, target)
    unclipped = _lanes_mul(error, error)
    clipped_value = _lanes_clip(value, _lanes_sub(old, clip_range), _lanes_add(old, clip_range))
    clipped_error = _lanes_sub(clipped_value, target)
    clipped = _lanes_mul(clipped_error, clipped_error)
    is_clipped = _lanes_gt(clipped, unclipped)
    sloped = _valid_and_not(valid, is_clipped)
    _lanes_put(grad, i, _lanes_where(sloped, _lanes_mul(error, scale), zero))
    chosen = _lanes_where(valid, _lanes_where(is_clipped, clipped, unclipped), zero)
    loss = _lanes_add(loss, _lanes_mul(_lanes_f64(chosen), _lanes_splat(0.5)))
    return loss, _count_valid_lanes(_valid_and(valid, is_clipped))


@_without_refcounts
def _value_rows(
    values, old_values, returns, starts, spans, lengths, mask, clip, scales, grad, row_loss,
    row_clipped, tail, tail_mask,
):  # fmt: skip
    """Twin: src/rows_loss.h ppo_value_loss_cases, row by row. Unlike the policy losses, every
    position of a row is computed, as in the twin (which says why), a chunk of _CHUNK positions
    at a time: the blocks wholly before the length with no test of it, the others with one, a
    row's last partial block in zero-padded lanes. Writes each row's loss and clipped count.
    Positions are signed (a block's count of positions before the length may be below 0). The
    loop over the rows is here, not in the caller: a call a row passed its arrays field by field
    (about 90 moves) and cost short rows 20-30 ns each (1.4x the twin's time at 1024 x 8)."""
    has_mask = mask.shape[0] > 0
    clip_range = _lanes_splat(clip)
    for b in range(starts.shape[0]):
        start, span, length = starts[b], spans[b], lengths[b]
        scale = scales[b]
        row_scales = _lanes_splat(scale)
        zero = _lanes_splat(scale - scale)  # as the twin: 0 in the dtype
        loss = _lanes_splat(0.0)
        clipped = 0
        within = (length - length % 8 if length > 0 else 0) if length < span else span - span % 8
        for first in range(0, span, _CHUNK):
            end = min(first + _CHUNK, span)
            whole_end = end - (end - first) % 8
            before_length = min(within, whole_end)
            for t in range(first, before_length, 8):
                if has_mask:
                    valid = _valid_bytes(mask, start + t)
                else:
                    valid = _valid_all()
                loss, block_clipped = _value_block(
                    valid, values, old_values, returns, start + t, clip_range, row_scales, zero,
                    grad, loss,
                )  # fmt: skip
                clipped += block_clipped
            for t in range(max(before_length, first), whole_end, 8):
                valid = _valid_first(length - t)
                if has_mask:
                    valid = _valid_and(valid, _valid_bytes(mask, start + t))
                loss, block_clipped = _value_block(
                    valid, values, old_values, returns, start + t, clip_range, row_scales, zero,
                    grad, loss,
                )  # fmt: skip
                clipped += block_clipped
            t = whole_end
            if t < end:
                count = end - t
                _tail_fill(
                    tail, tail_mask, values, old_values, returns, values, False, mask, has_mask,
                    start + t, count,
                )  # fmt: skip
                valid = _valid_and(_valid_bytes(tail_mask, 0), _valid_first(length - t))
                tail_grad = tail[4]
                loss, block_clipped = _value_block(
                    valid, tail[0], tail[1], tail[2], 0, clip_range, row_scales, zero, tail_grad,
                    loss,
                )  # fmt: skip
                clipped += block_clipped
                _lanes_put_first(grad, start + t, _lanes_of(tail_grad, 0), count)
        row_loss[b] = _lane_total(loss)
        row_clipped[b] = clipped


def value_loss(
    values,
    old_values,
    returns,
    starts,
    spans,
    lengths,
    mask,
    scales,
    clip,
    grad,
    row_loss,
    row_clipped,
):
    """Twin: src/rows_loss.h ppo_value_loss_row, in lanes (``_value_rows``): the clipped value
    loss's halved squares summed in float64 lanes added up in the twin's tree, the gradient, and
    the clipped count (a whole number)."""
    tail = _stack_array((5, 8), values.dtype)
    tail[:] = 0
    tail_mask = _stack_array((8,), np.uint8)
    tail_mask[:] = 0
    _value_rows(
        values, old_values, returns, starts, spans, lengths, mask, clip, scales, grad, row_loss,
        row_clipped, tail, tail_mask,
    )  # fmt: skip
