"""The NTK's top eigenpair: dense, or matrix-free by Lanczos.

Dense: ``scipy.linalg.eigh`` on a materialised kernel, asking only for the two
largest eigenpairs. Matrix-free: Lanczos with full reorthogonalisation on a
``LinearOperator`` whose matvec is ``v -> J (J^T v)``: ``J^T v`` is one weighted
backward pass (a VJP of ``sum_i v_i f(x_i)``) and ``J w`` one forward-mode pass (a
JVP), both chunked over the batch, so memory is O(P + n) and never holds J. It starts
from the all-ones vector and stops as soon as the top Ritz pair meets ARPACK's
criterion and the second Ritz value (lambda_2, for the eigengap) a looser one: both
from the same Krylov space, with no restart and no second solve (ARPACK's
``eigsh`` cannot stop on one pair while reporting another; the matvec counts are in
benchmarks/README.md).

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
from scipy.sparse.linalg import LinearOperator

from ntkscope.core.checks import InputError, entry
from ntkscope.core.progress import progress_bar
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


def krylov_top_two(matvec, n: int, v0: np.ndarray, *, tol: float = 1e-6, gap_tol: float = 1e-2,
                   max_steps: int | None = None) -> tuple[float, float, np.ndarray, int]:
    """lambda_1, lambda_2, u_1 and the matvecs spent, from one Lanczos run with full reorthogonalisation.

    After each matvec the tridiagonal ``T_m`` is diagonalised; the Ritz pair (theta, Q s) has
    residual ``|beta_m s_m|``. The run stops when the top pair's residual is at most
    ``tol * theta_1`` (ARPACK's criterion) and the second's at most ``gap_tol * theta_1``
    (lambda_2 only feeds the eigengap), or when the Krylov space is invariant. lambda_2 thus
    comes from the same Krylov space as lambda_1: no second solve (benchmarks/README.md compares
    matvecs with ARPACK's restarted Lanczos, a deflated second solve and LOBPCG).
    """
    max_steps = n if max_steps is None else min(n, max_steps)
    Q = np.zeros((n, max_steps + 1))
    alpha, beta = np.zeros(max_steps), np.zeros(max_steps)
    Q[:, 0] = v0 / np.linalg.norm(v0)
    for m in range(max_steps):
        w = matvec(Q[:, m])
        alpha[m] = Q[:, m] @ w
        w = w - alpha[m] * Q[:, m] - (beta[m - 1] * Q[:, m - 1] if m else 0.0)
        for _ in range(2):  # full reorthogonalisation, twice is enough (Parlett)
            w -= Q[:, : m + 1] @ (Q[:, : m + 1].T @ w)
        beta[m] = np.linalg.norm(w)
        theta, S = scipy.linalg.eigh_tridiagonal(alpha[: m + 1], beta[:m]) if m else (alpha[:1], np.ones((1, 1)))
        res = np.abs(beta[m] * S[-1])
        top = theta[-1]
        done_1 = res[-1] <= tol * abs(top)
        done_2 = m == 0 or res[-2] <= gap_tol * abs(top)
        invariant = beta[m] <= 1e-12 * max(abs(top), 1e-300)
        if invariant or (done_1 and done_2 and m >= 1) or m == max_steps - 1:
            u = Q[:, : m + 1] @ S[:, -1]
            second = theta[-2] if m else 0.0
            return float(top), float(second), u, m + 1
        Q[:, m + 1] = w / beta[m]
    raise AssertionError("unreachable")


def lanczos_top_eigenpair(op: NTKOperator, *, tol: float = 1e-6, ncv: int = 4,
                          gap_tol: float = 1e-2) -> EigenResult:
    """Top eigenpair of ``op`` by Lanczos from the all-ones vector, lambda_2 from the same Krylov space.

    ``u_max`` is solved to ``tol`` and lambda_2 to the looser ``gap_tol`` (:func:`krylov_top_two`).
    ``ncv`` is kept for compatibility: the basis grows until both have converged (at most n),
    there is no restart.
    """
    n = op.shape[0]
    if n < _DENSE_BELOW:
        cols = np.stack([op.matvec(e) for e in np.eye(n)], axis=1)
        res = dense_top_eigenpair(0.5 * (cols + cols.T))
        return _result(res.eigenvalue, res.second_eigenvalue, res.eigenvector, "matrix-free", op.matvecs)
    with progress_bar(None, "matrix-free NTK (Lanczos)", "matvec") as bar:
        def matvec(v):
            bar.update(1)
            return op.matvec(v)

        lam1, lam2, u, _ = krylov_top_two(matvec, n, np.ones(n), tol=tol, gap_tol=gap_tol)
    return _result(lam1, lam2, u, "matrix-free", op.matvecs)
