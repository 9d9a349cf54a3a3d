"""Fit the rational approximation of erf used by the CPU GELU kernels (tvm_kernels/schedules/cpu/microkernels.py).

erf(z) = z * P(s) / Q(s), s = z^2 / 16, |z| <= 4 (beyond, erf rounds to +-1 in float32), with Q(0) = 1:
P of degree 7 and Q of degree 4 for float32 (``_ERF_P``, ``_ERF_Q``), 4 and 3 for the half types'
forward, whose results are rounded to 8 or 11 bits (``_ERF_P_HALF``, ``_ERF_Q_HALF``). Linearised
least squares (P - f Q, weighted by 1 / Q of the previous step), then Lawson reweighting toward the
minimax of the absolute error of erf. Prints the coefficients (lowest degree first) and the error in
float64 and in float32 Horner evaluation.

    python tools/fit_erf.py                  # float32's fit
    python tools/fit_erf.py --degrees 4 3    # the half types'
"""

import argparse
import math

import numpy as np

Z_MAX = 4.0
P_DEGREE, Q_DEGREE = 7, 4
HALF_DEGREES = (4, 3)


def fit(p_degree: int = P_DEGREE, q_degree: int = Q_DEGREE, iterations: int = 60):
    z = np.linspace(0, Z_MAX, 20001)[1:]
    s = (z / Z_MAX) ** 2
    erf = np.array([math.erf(v) for v in z])
    f = erf / z
    q = np.zeros(q_degree + 1)
    q[0] = 1
    lawson = np.ones_like(s)
    best = None
    powers_p = np.vander(s, p_degree + 1, increasing=True)
    powers_q = np.vander(s, q_degree + 1, increasing=True)[:, 1:]
    for step in range(iterations):
        weight = lawson / np.abs(powers_q @ q[1:] + 1) * z
        system = np.hstack([powers_p, -f[:, None] * powers_q])
        solution = np.linalg.lstsq(system * weight[:, None], f * weight, rcond=None)[0]
        p, q = solution[: p_degree + 1], np.concatenate([[1.0], solution[p_degree + 1 :]])
        denominator = powers_q @ q[1:] + 1
        if np.any(denominator <= 0):
            break
        error = np.abs(z * (powers_p @ p) / denominator - erf)
        if best is None or error.max() < best[0]:
            best = (error.max(), p.copy(), q.copy())
        if step > 10:
            lawson = lawson * np.sqrt(error / error.max()) + 1e-12
            lawson /= lawson.max()
    return best


def float32_error(p, q) -> float:
    z = np.linspace(-4.5, 4.5, 300001).astype(np.float32)
    zc = np.clip(z, -Z_MAX, Z_MAX)
    s = (zc * zc * np.float32(1 / Z_MAX**2)).astype(np.float32)
    numerator, denominator = np.float32(p[-1]), np.float32(q[-1])
    for c in p[-2::-1]:
        numerator = (numerator * s + np.float32(c)).astype(np.float32)
    for c in q[-2::-1]:
        denominator = (denominator * s + np.float32(c)).astype(np.float32)
    approx = (zc * (numerator / denominator).astype(np.float32)).astype(np.float32)
    return float(np.abs(approx - np.array([math.erf(float(v)) for v in z])).max())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--degrees",
        type=int,
        nargs=2,
        default=(P_DEGREE, Q_DEGREE),
        metavar=("P", "Q"),
        help="degrees of P and Q (default: %(default)s)",
    )
    error, p, q = fit(*parser.parse_args().degrees)
    print(f"max |error| in float64: {error:.3g}; evaluated in float32: {float32_error(p, q):.3g}")
    print("P:", [float(c) for c in p])
    print("Q:", [float(c) for c in q])
