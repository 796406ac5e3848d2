"""Tenstorrent TILE layout: 32x32 tiles made of four 16x16 faces.

A tensor ``[..., H, W]`` is zero-padded to multiples of 32 in H and W, then cut into
tiles that are numbered row-major over ``(H/32, W/32)`` with the leading dims flattened
first. Inside a tile the 1024 elements are stored face by face (f0 = rows 0-15 x cols
0-15, f1 = rows 0-15 x cols 16-31, f2 = rows 16-31 x cols 0-15, f3 = rows 16-31 x cols
16-31), each face row-major: element (r, c) of a tile sits at
``f*256 + (r%16)*16 + c%16`` with ``f = (r//16)*2 + c//16``.

Functions work on torch tensors on any device and never loop per tile in Python.
"""

from __future__ import annotations

import torch

TILE = 32
FACE = 16
TILE_ELEMS = TILE * TILE  # 1024 elements per tile
FACE_ROWS_PER_TILE = 4 * FACE  # 64 face rows of 16 elements


def padded_hw(h: int, w: int) -> tuple[int, int]:
    """(H, W) rounded up to multiples of 32."""
    return -(-h // TILE) * TILE, -(-w // TILE) * TILE


def num_tiles(shape: tuple[int, ...] | torch.Size) -> int:
    """Number of 32x32 tiles of a tensor of ``shape`` [..., H, W] after padding."""
    *lead, h, w = shape
    hp, wp = padded_hw(h, w)
    n = 1
    for d in lead:
        n *= d
    return n * (hp // TILE) * (wp // TILE)


def tile_view(x: torch.Tensor) -> torch.Tensor:
    """View of ``x`` [..., H, W] (H, W multiples of 32) as
    ``[..., H/32, W/32, 2, 2, 16, 16]`` = (tile row, tile col, face row, face col, r, c).

    No copy; the caller flattens with ``reshape(-1, 1024)`` to get face-ordered tiles."""
    *lead, h, w = x.shape
    if h % TILE or w % TILE:
        raise ValueError(f"tile_view needs H and W multiples of {TILE}, got {tuple(x.shape)}")
    v = x.reshape(*lead, h // TILE, 2, FACE, w // TILE, 2, FACE)
    nl = len(lead)
    order = list(range(nl)) + [nl + i for i in (0, 3, 1, 4, 2, 5)]
    return v.permute(order)


def tilize(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., H, W] -> ``[num_tiles, 1024]`` elements in TILE order (zero padding)."""
    *lead, h, w = x.shape
    hp, wp = padded_hw(h, w)
    if (hp, wp) != (h, w):
        x = torch.nn.functional.pad(x, (0, wp - w, 0, hp - h))
    return tile_view(x).reshape(-1, TILE_ELEMS)


def untilize(tiles: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Inverse of :func:`tilize`: ``[num_tiles, 1024]`` -> tensor of ``shape`` [..., H, W]."""
    *lead, h, w = shape
    hp, wp = padded_hw(h, w)
    nl = len(lead)
    v = tiles.reshape(*lead, hp // TILE, wp // TILE, 2, 2, FACE, FACE)
    # (tr, tc, fr, fc, r, c) -> (tr, fr, r, tc, fc, c)
    order = list(range(nl)) + [nl + i for i in (0, 2, 4, 1, 3, 5)]
    full = v.permute(order).reshape(*lead, hp, wp)
    return full[..., :h, :w]
