"""MXFP4 experts (the OCP microscaling format GPT-OSS is published in) read into ordinary float arrays.

A checkpoint stores an expert weight `W` [e, X, Y] (transformers' layout) as `{name}_blocks`, uint8 [e, Y, X/32, 16]
(32 four-bit E2M1 values per block of the transposed weight, two per byte, low nibble first), and `{name}_scales`,
uint8 [e, Y, X/32] (each block's power of two, E8M0: 2 ** (scale - 127)). Reading dequantizes once; training and
sampling then see the weights as any other.
"""

from __future__ import annotations

import numpy as np

__all__ = ["dequantize"]

# The sixteen E2M1 values, indexed by their four bits (sign, two exponent bits, one mantissa bit).
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [e, X, Y] from `blocks` uint8 [e, Y, G, B] and `scales` uint8 [e, Y, G] (X = G * 2B); ValueError
    naming the mismatch when the two do not belong together."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4: blocks {blocks.dtype}{list(blocks.shape)} and scales "
                         f"{scales.dtype}{list(scales.shape)} are not one uint8 weight (scales = blocks' shape "
                         "but the last)")
    values = np.empty((*blocks.shape, 2), np.float32)
    values[..., 0] = _E2M1[blocks & 0x0F]
    values[..., 1] = _E2M1[blocks >> 4]
    values *= np.exp2(scales.astype(np.float32) - 127.0)[..., None, None]
    *lead, groups, width, _ = values.shape
    return values.reshape(*lead, groups * width * 2).swapaxes(-1, -2)
