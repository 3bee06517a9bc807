"""Hadamard rotations of activation rows: x [..., K] -> x Q with Q orthonormal, in O(K log K) per row.

Per-token INT8 quantization sets each row's scale by its largest entry, so a few outlier channels
waste most of the 8 bits. An orthonormal Hadamard rotation spreads every channel over all of them
(QuaRot, Ashkboos et al., 2024); the inverse goes into the weight offline (W Q), so
(x Q)(W Q)^T = x W^T exactly in real arithmetic.

Construction, for K = 2^e * r (r odd): Q = I_c (x) (H_m (x) H_n) / sqrt(m n) with
  * H_n the Sylvester matrix of order n (a power of two), applied as a fast Walsh-Hadamard transform;
  * H_m a Paley matrix of order m = 4d (d the largest divisor of r with a Paley construction: 4d - 1
    prime, or 2d - 1 prime and 1 mod 4), m = 1 when d = 1;
  * c = K / (m n) independent blocks (1 for every size the supported models have: 576, 640, 896,
    1536, 2048, 4864, 8960, 12288, 14336, ...), so the rotation is block-diagonal only where no
    Hadamard matrix of order K is known here.
`HadamardRotation.matrix()` builds the dense Q (the test oracle); tests check Q Q^T = I.

`rotate_rows_reference` uses elementwise operations only (butterflies a + b, a - b, then the H_m
mix as ordered sums of +-z, then one scaling), so each row's bits depend on that row alone:
row-stable by construction on every device, and bit for bit the C kernel's (ops/hadamard_cpu.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

ROTATION_CONSTRUCTION = "sylvester-paley-v1"  # recorded in checkpoints: a change here must change this name


# Every tensor here is built on the CPU explicitly: checkpoints are loaded under a meta-device context
# (Transformers' empty-weight init), and a rotation must be the same wherever it is first built.
_CPU = torch.device("cpu")


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % p for p in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = chi(j - i mod q), chi the quadratic character of the prime field F_q (int64 [q, q])."""
    squares = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=torch.int64, device=_CPU)
    index = (torch.arange(q, device=_CPU)[None, :] - torch.arange(q, device=_CPU)[:, None]) % q
    return chi[index]


def has_paley_construction(order: int) -> bool:
    """True when `paley_matrix(order)` builds a matrix (Paley I: order - 1 prime; II: order / 2 - 1 prime, 1 mod 4)."""
    if order % 4:
        return False
    return _is_prime(order - 1) or ((order // 2 - 1) % 4 == 1 and _is_prime(order // 2 - 1))


def paley_matrix(order: int) -> torch.Tensor | None:
    """A Hadamard matrix (+-1, int64 [order, order]) by Paley's construction I or II over a prime field,
    or None when neither applies to `order`."""
    q = order - 1
    if order % 4 == 0 and _is_prime(q):  # Paley I: q = 3 mod 4
        jac = _jacobsthal(q)
        s = torch.zeros(order, order, dtype=torch.int64, device=_CPU)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, jac
        return s + torch.eye(order, dtype=torch.int64, device=_CPU)
    q = order // 2 - 1
    if order % 4 == 0 and q % 4 == 1 and _is_prime(q):  # Paley II: q = 1 mod 4
        c = torch.zeros(q + 1, q + 1, dtype=torch.int64, device=_CPU)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, _jacobsthal(q)
        zero = torch.tensor([[1, -1], [-1, -1]], device=_CPU)
        one = torch.tensor([[1, 1], [1, -1]], device=_CPU)
        return torch.cat([torch.cat([zero if v == 0 else v * one for v in row], dim=1) for row in c.tolist()], dim=0)
    return None


def sylvester_matrix(order: int) -> torch.Tensor:
    """The Sylvester-Hadamard matrix of a power-of-two order (+-1, int64): H_2n = [[H, H], [H, -H]]."""
    if order < 1 or order & (order - 1):
        raise ValueError(f"a Sylvester matrix needs a power-of-two order, got {order}")
    h = torch.ones(1, 1, dtype=torch.int64, device=_CPU)
    while h.shape[0] < order:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


@dataclass(frozen=True)
class HadamardRotation:
    """The orthonormal rotation of rows of width `size`: I_blocks (x) (H_odd (x) H_pow2) / sqrt(odd * pow2)."""

    size: int
    blocks: int
    odd_order: int  # m: 1, or the order of a Paley matrix
    pow2: int  # n: a power of two

    @classmethod
    def for_size(cls, size: int) -> HadamardRotation:
        """The largest-block rotation this module can build for rows of `size` (any size >= 1)."""
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"a Hadamard rotation needs a positive row width, got {size!r}")
        return _rotation_for(size)

    @property
    def block(self) -> int:
        return self.odd_order * self.pow2

    @functools.cached_property
    def scale(self) -> float:
        """1 / sqrt(block) rounded to fp32: the one scaling both implementations apply."""
        return float(torch.tensor(1.0 / math.sqrt(self.block), dtype=torch.float32, device=_CPU))

    def odd_signs(self) -> torch.Tensor:
        """H_m as fp32 +-1 [m, m] (a 1 x 1 [[1]] when m = 1)."""
        if self.odd_order == 1:
            return torch.ones(1, 1, device=_CPU)
        matrix = paley_matrix(self.odd_order)
        assert matrix is not None  # for_size only picks constructible orders
        return matrix.float()

    def matrix(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The dense orthonormal Q [size, size] (x Q is the rotation): the oracle for tests."""
        block = torch.kron(self.odd_signs().double(), sylvester_matrix(self.pow2).double()) / math.sqrt(self.block)  # CPU
        return torch.block_diag(*([block] * self.blocks)).to(dtype)


@functools.lru_cache(maxsize=64)
def _rotation_for(size: int) -> HadamardRotation:
    exponent = (size & -size).bit_length() - 1
    odd = size >> exponent
    if exponent >= 2:
        for d in sorted((d for d in range(1, odd + 1) if odd % d == 0), reverse=True):
            if d == 1 or has_paley_construction(4 * d):
                m = 1 if d == 1 else 4 * d
                n = 2**exponent if d == 1 else 2 ** (exponent - 2)
                return HadamardRotation(size, size // (m * n), m, n)
    return HadamardRotation(size, odd, 1, 2**exponent)


def rotation_layout(size: int) -> list[int]:
    """[blocks, odd_order, pow2] of the rotation of rows of `size` (what checkpoints record)."""
    r = HadamardRotation.for_size(size)
    return [r.blocks, r.odd_order, r.pow2]


def rotate_rows_reference(x: torch.Tensor, rotation: HadamardRotation) -> torch.Tensor:
    """x [..., K] (any float dtype) -> fp32 [..., K] = x Q, by elementwise operations in a fixed order."""
    if x.shape[-1] != rotation.size:
        raise ValueError(f"rotation is for rows of {rotation.size}, got x of shape {tuple(x.shape)}")
    lead = x.shape[:-1]
    c, m, n = rotation.blocks, rotation.odd_order, rotation.pow2
    z = _sylvester_butterflies(x.reshape(-1, c, m, n).float())
    if m > 1:  # y[p] = sum over p' (ascending) of H_m[p', p] z[p']
        signs = rotation.odd_signs().to(z.device)[:, None, :, None]  # [m, 1, m, 1]
        acc = signs[0] * z[:, :, 0:1, :]
        for p in range(1, m):
            acc = acc + signs[p] * z[:, :, p : p + 1, :]
        z = acc
    return (z * rotation.scale).reshape(*lead, rotation.size)


def _sylvester_butterflies(z: torch.Tensor) -> torch.Tensor:
    """z [..., n] -> z H_n (Sylvester, unnormalized): butterflies on pairs (j, j + h) inside blocks of
    2h, log2(n) passes of additions in a fixed order, in z's dtype."""
    n = z.shape[-1]
    lead = z.shape[:-1]
    h = 1
    while h < n:
        pairs = z.reshape(*lead, n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        z = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    return z


GEMM_CHUNK_ELEMENTS = 1 << 24  # elements per pass of rotate_rows_gemm (bounds its temporaries)
DIRECT_SYLVESTER_MAX = 256  # H_n of at most this order is one GEMM; larger ones split as H_a (x) H_b


def sylvester_split(n: int) -> tuple[int, int]:
    """(a, b) with H_n = H_a (x) H_b as the matrix-product rotations apply it: (1, n) up to
    DIRECT_SYLVESTER_MAX (one GEMM), else a = 2^floor(log2(n) / 2)."""
    a = 1 if n <= DIRECT_SYLVESTER_MAX else 1 << (n.bit_length() - 1) // 2
    return a, n // a


def rotate_rows_float64(x: torch.Tensor, rotation: HadamardRotation) -> torch.Tensor:
    """x [..., K] -> float64 x Q, for weights prepared offline, where accuracy matters and row-stability
    does not (rotate_rows_gemm in float64)."""
    return rotate_rows_gemm(x, rotation, torch.float64)


def rotate_rows_gemm(x: torch.Tensor, rotation: HadamardRotation, dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] -> x Q computed in `dtype` as matrix products, for offline work where throughput
    matters and row-stability does not (weights prepared offline: rotate_rows_float64).

    Each block of a row, viewed as [m, n], is multiplied by H_n on the n axis (one GEMM; past
    DIRECT_SYLVESTER_MAX as H_a (x) H_b, Sylvester matrices being Kronecker powers: K (a + b)
    multiply-adds per row instead of K n), then by H_m / sqrt(m n) on the m axis. Rows go in chunks
    of about GEMM_CHUNK_ELEMENTS so the temporaries stay bounded."""
    if x.shape[-1] != rotation.size:
        raise ValueError(f"rotation is for rows of {rotation.size}, got x of shape {tuple(x.shape)}")
    m, n = rotation.odd_order, rotation.pow2
    a, b = sylvester_split(n)
    h_a = sylvester_matrix(a).to(x.device, dtype)
    h_b = sylvester_matrix(b).to(x.device, dtype)
    odd = (rotation.odd_signs().double() / math.sqrt(rotation.block)).to(x.device, dtype)  # H_m, scaled
    rows = x.reshape(-1, rotation.size)
    out = torch.empty(rows.shape, dtype=dtype, device=x.device)
    step = max(1, GEMM_CHUNK_ELEMENTS // rotation.size)
    for start in range(0, rows.shape[0], step):
        z = rows[start : start + step].to(dtype)  # [r, K] = [r, c m a b]
        r = z.shape[0]
        z = z.reshape(-1, b) @ h_b  # X H_b on the b axis
        if a > 1:
            z = _mix_middle_axis(z.reshape(-1, a, b), h_a)  # H_a on the a axis
        z = _mix_middle_axis(z.reshape(-1, m, n), odd)  # H_m^T on the m axis, and the 1 / sqrt(m n)
        out[start : start + r] = z.reshape(r, rotation.size)
    return out.reshape(*x.shape[:-1], rotation.size)


def rotate_columns_gemm(matrix: torch.Tensor, rotation: HadamardRotation, dtype: torch.dtype) -> torch.Tensor:
    """matrix [K, W] -> Q^T matrix computed in `dtype` as matrix products: each column rotated as
    rotate_rows_gemm rotates a row, with every product applied from the left on contiguous slabs.
    Columns go in chunks of about GEMM_CHUNK_ELEMENTS, each copied contiguous first (a transposed
    `matrix` is transposed one chunk at a time)."""
    if matrix.dim() != 2 or matrix.shape[0] != rotation.size:
        raise ValueError(f"rotation is for columns of {rotation.size}, got a matrix of shape {tuple(matrix.shape)}")
    k, width = matrix.shape
    c, m, n = rotation.blocks, rotation.odd_order, rotation.pow2
    a, b = sylvester_split(n)
    scale = 1.0 / math.sqrt(rotation.block)
    h_b = sylvester_matrix(b).to(matrix.device, dtype).t()  # H_b^T, scaled below when there is no H_m
    h_a = sylvester_matrix(a).to(matrix.device, dtype).t()
    odd = (rotation.odd_signs().double().t() * scale).to(matrix.device, dtype)  # H_m^T / sqrt(m n)
    if m == 1:
        h_b = h_b * scale
    out = torch.empty(k, width, dtype=dtype, device=matrix.device)
    step = max(1, GEMM_CHUNK_ELEMENTS // k)
    for start in range(0, width, step):
        w = min(step, width - start)
        z = matrix[:, start : start + w].to(dtype).contiguous().view(c * m * a, b, w)  # rows = [c, m, a, b]
        z = torch.matmul(h_b, z)  # H_b^T on the b axis
        if a > 1:
            z = torch.matmul(h_a, z.view(c * m, a, b * w))  # H_a^T on the a axis
        if m > 1:
            z = torch.matmul(odd, z.view(c, m, a * b * w))  # H_m^T / sqrt(m n) on the m axis
        out[:, start : start + w] = z.view(k, w)
    return out


def _mix_middle_axis(z: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """z [B, p, q], matrix [p, s] -> y [B, s, q] with y[:, s, :] = sum over p of matrix[p, s] z[:, p, :]."""
    return torch.matmul(z.transpose(1, 2), matrix).transpose(1, 2)
