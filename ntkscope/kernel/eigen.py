"""The NTK's top eigenpair: dense, or matrix-free by Lanczos.

Dense: ``scipy.linalg.eigh`` on a materialised kernel, asking only for the two
largest eigenpairs. Matrix-free: ``scipy.sparse.linalg.eigsh`` (ARPACK's
implicitly restarted Lanczos) on a ``LinearOperator`` whose matvec is
``v -> J (J^T v)``: ``J^T v`` is one weighted backward pass (a VJP of
``sum_i v_i f(x_i)``) and ``J w`` one forward-mode pass (a JVP), both chunked
over the batch, so memory is O(P + n) and never holds J. ``ncv=4`` and the
all-ones start vector were measured to need 5-7 matvecs where scipy's default
``ncv=20`` spends 21 (docs/design.md §6). lambda_2, for the eigengap, comes from a
loosely solved deflated operator.

Conventions (docs/design.md §1): ``u`` has unit norm and ``sum(u) > 0`` (if the sum
is 0, the first non-zero entry is positive). ``eigengap = lambda_2 / lambda_1``, reported
with every eigenpair; how far ``u`` can be trusted is a statistic of gradient consistency
(:mod:`ntkscope.kernel.uncertainty`), not a warning here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import scipy.linalg
import torch
from scipy.sparse.linalg import LinearOperator, eigsh

from ntkscope.core.checks import InputError, entry
from ntkscope.kernel.grads import FunctionalModel, jvp_rows, vjp_rows

log = logging.getLogger(__name__)

_DENSE_BELOW = 6  # Lanczos needs ncv < n; a handful of matvecs materialise such small kernels exactly


@dataclass(frozen=True)
class EigenResult:
    """Top eigenpair of an NTK.

    Attributes
    ----------
    eigenvalue : float
        lambda_1.
    eigenvector : ndarray of shape (n,)
        u_max, unit norm, ``sum(u) > 0``.
    second_eigenvalue : float
        lambda_2 (0 for n = 1).
    eigengap : float
        lambda_2 / lambda_1 (near 1: two near-equal directions, u_max is ill-defined).
    method : {"dense", "matrix-free"}
    matvecs : int
        Kernel-vector products spent (0 for dense).
    """

    eigenvalue: float
    eigenvector: np.ndarray
    second_eigenvalue: float
    eigengap: float
    method: str
    matvecs: int = 0


def orient(u: np.ndarray) -> np.ndarray:
    """Unit-normalise and flip so that ``sum(u) > 0`` (first non-zero entry > 0 if the sum is 0)."""
    u = np.asarray(u, dtype=np.float64)
    u = u / np.linalg.norm(u)
    total = u.sum()
    tol = 64 * np.finfo(np.float64).eps * np.sqrt(u.size)
    if abs(total) > tol:
        return u if total > 0 else -u
    nonzero = np.flatnonzero(np.abs(u) > tol)
    return u if nonzero.size == 0 or u[nonzero[0]] > 0 else -u


def _result(lam1, lam2, u, method, matvecs) -> EigenResult:
    if lam1 <= 0:
        raise InputError("batch", "has an NTK with no positive eigenvalue (all gradients are zero); lambda_max",
                         float(lam1))
    gap = float(max(lam2, 0.0) / lam1)
    return EigenResult(float(lam1), orient(u), float(lam2), gap, method, matvecs)


@entry("top_eigenpair")
def top_eigenpair(matrix) -> EigenResult:
    """Top eigenpair of a symmetric PSD kernel of shape (n, n), densely.

    Parameters
    ----------
    matrix : Tensor or ndarray of shape (n, n)

    Returns
    -------
    EigenResult
    """
    A = matrix.detach().cpu().numpy() if torch.is_tensor(matrix) else np.asarray(matrix)
    if A.ndim != 2 or A.shape[0] != A.shape[1] or A.shape[0] == 0:
        raise InputError("matrix", "must be a non-empty square matrix of shape (n, n)", A.shape)
    if not np.isfinite(A).all():
        raise InputError("matrix", "must be finite", "NaN/inf entries")
    return dense_top_eigenpair(A)


def dense_top_eigenpair(matrix) -> EigenResult:
    """Top eigenpair of a valid (n, n) kernel (Tensor or ndarray) by ``scipy.linalg.eigh``."""
    A = matrix.detach().cpu().numpy() if torch.is_tensor(matrix) else np.asarray(matrix)
    A = A.astype(np.float64, copy=False)
    n = A.shape[0]
    vals, vecs = scipy.linalg.eigh(A, subset_by_index=[max(0, n - 2), n - 1])
    lam2 = vals[0] if n > 1 else 0.0
    return _result(vals[-1], lam2, vecs[:, -1], "dense", 0)


class NTKOperator(LinearOperator):
    """``v -> Theta v = J (J^T v)`` without forming J or Theta; counts its matvecs."""

    def __init__(self, fm: FunctionalModel, data: dict, n: int, chunk_size: int):
        super().__init__(dtype=np.float64, shape=(n, n))
        self.fm, self.data, self.n, self.chunk = fm, data, n, chunk_size
        self.matvecs = 0

    def _matvec(self, v):
        self.matvecs += 1
        fm = self.fm
        v = torch.as_tensor(np.asarray(v).reshape(-1), dtype=fm.dtype, device=fm.device)
        jt_v = vjp_rows(fm, self.data, v, self.chunk)  # (P,) = J^T v
        out = jvp_rows(fm, self.data, jt_v, self.chunk, self.n)  # (n,) = J J^T v
        return out.detach().cpu().double().numpy()

    def _rmatvec(self, v):  # symmetric
        return self._matvec(v)


def lanczos_top_eigenpair(op: NTKOperator, *, tol: float = 1e-6, ncv: int = 4,
                          gap_tol: float = 1e-2) -> EigenResult:
    """Top eigenpair of ``op`` by ARPACK Lanczos from the all-ones vector, then lambda_2 for the eigengap.

    ``u_max`` is solved to ``tol``; lambda_2 is the top eigenvalue of the deflated
    operator ``Theta - lambda_1 u u^T`` solved to the looser ``gap_tol`` (it only
    feeds the eigengap). Measured: this costs 30% fewer matvecs than asking
    ARPACK for both eigenpairs at ``tol`` (benchmarks/README.md).
    """
    n = op.shape[0]
    if n < _DENSE_BELOW:
        cols = np.stack([op.matvec(e) for e in np.eye(n)], axis=1)
        res = dense_top_eigenpair(0.5 * (cols + cols.T))
        return _result(res.eigenvalue, res.second_eigenvalue, res.eigenvector, "matrix-free", op.matvecs)
    v0 = np.ones(n) / np.sqrt(n)
    vals, vecs = eigsh(op, k=1, which="LA", ncv=min(n, ncv), tol=tol, v0=v0)
    lam1, u = float(vals[0]), vecs[:, 0]
    deflated = LinearOperator((n, n), matvec=lambda v: op.matvec(v) - lam1 * u * (u @ v), dtype=np.float64)
    start = v0 - u * (u @ v0)
    if np.linalg.norm(start) < 1e-8:  # u is the all-ones direction: start anywhere orthogonal to it
        start = np.random.default_rng(0).standard_normal(n)
        start -= u * (u @ start)
    (lam2,), _ = eigsh(deflated, k=1, which="LA", ncv=min(n, ncv), tol=gap_tol, v0=start)
    return _result(lam1, float(lam2), u, "matrix-free", op.matvecs)
