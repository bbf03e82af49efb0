"""GEMMs in a compute dtype accumulating in float32, whose backward GEMMs run in that dtype too.

Shape letters (docs/shape_letters.md): M rows (flattened tokens, or query positions), X the contracted axis and
Y the output columns of the forward GEMM; a batched GEMM's leading axes ("...", attention's [B, C]) are shared by
both operands. Under mixed precision the backward rounds the float32 cotangent to bfloat16 too, as torch.autocast
does (JAX's own transpose of a dot with a float32 result would run float32 GEMMs), and gradients come back in the
operands' own dtypes from the float32 accumulator. Operands are laid out for XLA's CPU bf16 GEMM (`row_major`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["dense", "is_half", "matmul", "matmul_nt", "mm", "mm_nt", "mm_tn", "row_major", "transposed"]

_F32 = jnp.float32


def is_half(dtype) -> bool:
    """16-bit float (bfloat16, float16)."""
    return jnp.dtype(dtype).itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)


def transposed(x_MX: jax.Array) -> jax.Array:
    """x with its last two axes swapped, materialised: the barrier stops XLA folding the transpose into the next
    dot and choosing its own layout.

    A 16-bit x goes through a flat reshape, which forces a row-major copy: XLA's CPU bf16 dot is fast (XNNPACK)
    only on a row-major operand, and without it the backward's bf16 GEMMs were slower than float32's.
    """
    x_XM = jnp.swapaxes(x_MX, -1, -2)
    if not is_half(x_MX.dtype):
        return jax.lax.optimization_barrier(x_XM)
    return jax.lax.optimization_barrier(x_XM.reshape(-1)).reshape(x_XM.shape)


# ---------------------------------------------------------------- a projection: [M, X] @ [X, Y]


def dense(x_MX: jax.Array, w_XY: jax.Array, dtype=None) -> jax.Array:
    """[M, X] @ [X, Y] as one GEMM in `dtype` (None: the weight's) accumulating in float32, cast back to x's dtype.

    A bfloat16 `dtype` under float32 activations and weights (mixed precision) rounds both to bfloat16 for the
    GEMM only: the residual stream and everything elementwise stay float32, and the weight's gradient float32.
    """
    return _dense(x_MX, w_XY, w_XY.dtype if dtype is None else jnp.dtype(dtype), w_XY.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense(x_MX: jax.Array, w_XY: jax.Array, low, w_dtype) -> jax.Array:
    """`dense` in compute dtype `low`; `w_dtype` (w's own) is what the weight's gradient comes back in."""
    # float32 accumulation also makes bf16 fast on CPU: XLA's CPU dot with a bf16 output is slower than with f32.
    return jnp.dot(x_MX.astype(low), w_XY.astype(low), preferred_element_type=_F32).astype(x_MX.dtype)


def _dense_fwd(x_MX: jax.Array, w_XY: jax.Array, low, w_dtype):
    """Output and the residuals the backward needs (the GEMM's inputs in the compute dtype)."""
    return _dense(x_MX, w_XY, low, w_dtype), (x_MX.astype(low), w_XY.astype(low))


def _dense_bwd(low, w_dtype, residuals, dy_MY: jax.Array):
    """(dx, dw), the weight gradient transposing the narrower of x and dy: one copy of [M, min(X, Y)]."""
    # Left to itself, XLA's CPU layout assignment transposed the wider operand (the [M, I] MLP activations)
    # inside the layer scan, fused with the stacked residual's dynamic-slice into a strided loop that cost as
    # much as the largest GEMMs.
    x_MX, w_XY = residuals  # in the compute dtype; dy in x's original dtype, which dx takes
    w_YX = transposed(w_XY) if is_half(low) else w_XY.T
    dx_MX = jnp.dot(dy_MY.astype(low), w_YX, preferred_element_type=_F32).astype(dy_MY.dtype)
    dy_MY = dy_MY.astype(low)
    # 16-bit: always x.T @ dy; (dy.T @ x).T asks XLA's CPU for a bf16 dot with a transposed f32 output, which
    # it refuses ("Unsupported element type for DotThunk").
    if is_half(low) or x_MX.shape[1] <= dy_MY.shape[1]:
        dw_XY = jnp.dot(transposed(x_MX), dy_MY, preferred_element_type=_F32)
    else:
        dw_XY = jnp.dot(transposed(dy_MY), x_MX, preferred_element_type=_F32).T
    return dx_MX, dw_XY.astype(w_dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


# ---------------------------------------------------------------- batched: attention's [..., M, X] @ [..., X, Y]


def row_major(x: jax.Array) -> jax.Array:
    """A 16-bit x materialised row-major as it stands (others unchanged).

    XLA's CPU backend hands a bf16 dot to YNNPACK only when its left operand is row-major with the contracted axis
    minor and its result is not transposed. Without the barrier XLA folds the transposes that made an operand
    (attention's head-major q, k, v) into the dot's dimension numbers, and its CPU backend then silently upcasts
    the dot to a much slower float32 one (or, with a transposed result, refuses it: see `mm_tn`).
    """
    if not is_half(x.dtype):
        return x
    return jax.lax.optimization_barrier(x.reshape(-1)).reshape(x.shape)


def mm(x_MX: jax.Array, y_XY: jax.Array) -> jax.Array:
    """[..., M, X] @ [..., X, Y] accumulating in float32 (no custom gradient: for backward passes)."""
    return jnp.einsum("...mx,...xy->...my", row_major(x_MX), row_major(y_XY), preferred_element_type=_F32)


def mm_nt(x_MX: jax.Array, y_YX: jax.Array) -> jax.Array:
    """[..., M, X] @ [..., Y, X]^T accumulating in float32."""
    return jnp.einsum("...mx,...yx->...my", row_major(x_MX), row_major(y_YX), preferred_element_type=_F32)


def mm_tn(x_MX: jax.Array, g_MY: jax.Array) -> jax.Array:
    """[..., M, X]^T @ [..., M, Y] accumulating in float32 (a weight gradient), the cheaper way round.

    The left operand must be a row-major [.., K, M] copy: x^T (M * X elements) gives the result as it is; g^T
    (M * Y) gives it transposed, one more copy of the [X, Y] float32 result (counted as two bf16 elements).
    """
    # The barriers keep the dot's float32 result row-major: XLA would fold a transpose after it (the swap
    # here, or the caller's, e.g. a tied embedding's) into the dot, giving a bf16 dot with a transposed
    # operand that its CPU backend refuses ("Unsupported element type for DotThunk").
    M, X, Y = *x_MX.shape[-2:], g_MY.shape[-1]
    if M * X <= M * Y + 2 * X * Y:
        return jax.lax.optimization_barrier(mm(transposed(x_MX), g_MY))
    return jnp.swapaxes(jax.lax.optimization_barrier(mm(transposed(g_MY), x_MX)), -1, -2)


def matmul(x_MX: jax.Array, y_XY: jax.Array, dtype) -> jax.Array:
    """float32 [..., M, X] @ [..., X, Y], both operands rounded to `dtype` (bfloat16: attention's P V)."""
    return _low_matmul(x_MX, y_XY, jnp.dtype(dtype), x_MX.dtype, y_XY.dtype, False)


def matmul_nt(x_MX: jax.Array, y_YX: jax.Array, dtype) -> jax.Array:
    """float32 [..., M, X] @ [..., Y, X]^T, both operands rounded to `dtype` (bfloat16: attention's Q K^T)."""
    return _low_matmul(x_MX, y_YX, jnp.dtype(dtype), x_MX.dtype, y_YX.dtype, True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _low_matmul(x_MX, y, low, x_dtype, y_dtype, y_transposed):
    """x @ y (`y_transposed`: x @ y^T, y read in place) in `low`; gradients come back in `x_dtype` and `y_dtype`."""
    return (mm_nt if y_transposed else mm)(x_MX.astype(low), y.astype(low))


def _low_matmul_fwd(x_MX, y, low, x_dtype, y_dtype, y_transposed):
    """Output and the operands in `low`."""
    return _low_matmul(x_MX, y, low, x_dtype, y_dtype, y_transposed), (x_MX.astype(low), y.astype(low))


def _low_matmul_bwd(low, x_dtype, y_dtype, y_transposed, residuals, g_MY):
    """(dx, dy) in `low` accumulating in float32: (g y, g^T x) for x y^T, (g y^T, x^T g) for x y."""
    x_MX, y = residuals
    g_MY = g_MY.astype(low)
    if y_transposed:
        return mm(g_MY, y).astype(x_dtype), mm_tn(g_MY, x_MX).astype(y_dtype)
    return mm_nt(g_MY, y).astype(x_dtype), mm_tn(x_MX, g_MY).astype(y_dtype)


_low_matmul.defvjp(_low_matmul_fwd, _low_matmul_bwd)
