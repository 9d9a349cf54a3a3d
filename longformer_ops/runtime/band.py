"""The band's geometry, shared by the kernels' wrappers, the ops and the plain references.

A band tensor ``[batch, seq, heads, c]`` holds, for query ``i`` of head ``h``, the keys
``i + d[h] * (j - w)`` for ``j < c``, ``c = 2w + 1`` (``w + 1`` when autoregressive). Keys outside
``[0, seq)`` are the band's invalid locations.
"""

from __future__ import annotations

import torch


def band_width(w: int, autoregressive: bool) -> int:
    return w + (0 if autoregressive else w) + 1


def key_positions(seq_len: int, w: int, dilation: torch.Tensor, autoregressive: bool) -> torch.Tensor:
    """Key index ``i + dil[h] * (j - w)`` for every (i, h, j): int64 ``[seq, heads, c]``."""
    c = band_width(w, autoregressive)
    i = torch.arange(seq_len, device=dilation.device).view(seq_len, 1, 1)
    j = torch.arange(c, device=dilation.device).view(1, 1, c)
    return i + dilation.to(torch.int64).view(1, -1, 1) * (j - w)


def invalid_locations(seq_len: int, w: int, dilation: torch.Tensor, autoregressive: bool) -> torch.Tensor:
    """Bool ``[seq, heads, c]``: True where the key falls outside ``[0, seq)``."""
    keys = key_positions(seq_len, w, dilation, autoregressive)
    return (keys < 0) | (keys >= seq_len)


def fill_invalid_locations_(
    band: torch.Tensor, w: int, dilation: tuple[int, ...], autoregressive: bool, value: float
) -> torch.Tensor:
    """In place, ``band [b, n, h, c]`` = ``value`` where the key falls outside ``[0, n)``; returns ``band``.

    Only the first and last ``w * max(d)`` rows can hold such positions, and only those are touched:
    the mask is of their size, not the band's (plain torch ops: differentiable, traced by torch.compile).
    Without autograd recording, the edge rows go in blocks of ``EDGE_BLOCK_ROWS``, so the mask stays
    small at large dilations too; a band that requires grad gets one fill per edge instead (each
    in-place fill of a slice costs autograd a copy of the band's gradient).
    """
    n = band.shape[1]
    if isinstance(dilation, torch.Tensor):  # under torch.compile, values unseen: one fill the compiler fuses
        return band.masked_fill_(invalid_locations(n, w, dilation.to(band.device), autoregressive), value)
    reach = min(n, w * max(dilation, default=1))  # rows farther from both ends see only valid keys
    if reach == 0:
        return band
    edges = [(0, n)] if 2 * reach >= n else [(0, reach)] + ([] if autoregressive else [(n - reach, n)])
    if not (torch.is_grad_enabled() and band.requires_grad):
        edges = [
            (r, min(r + EDGE_BLOCK_ROWS, stop)) for start, stop in edges for r in range(start, stop, EDGE_BLOCK_ROWS)
        ]
    columns = torch.arange(band_width(w, autoregressive), device=band.device).view(1, 1, -1)
    d = torch.tensor(dilation, device=band.device).view(1, -1)
    for start, stop in edges:
        rows = torch.arange(start, stop, device=band.device).view(-1, 1)
        # Key i + d (j - w) is in [0, n) exactly for w - i // d <= j <= w + (n - 1 - i) // d: two
        # [rows, h] bounds and one bool mask [rows, h, c], no int64 index of the rows' band shape.
        invalid = columns < (w - torch.div(rows, d, rounding_mode="floor")).unsqueeze(-1)
        invalid |= columns > (w + torch.div(n - 1 - rows, d, rounding_mode="floor")).unsqueeze(-1)
        band[:, start:stop].masked_fill_(invalid, value)
    return band


EDGE_BLOCK_ROWS = 256
