"""The calibration hold-out: the last share of the samples, kept out of every fit to judge its result.

One rule for every guard (GPTQ's act-order/RTN choice, AWQ's scales and clips, learned rounding's fallback) and
one share, recipe calibration.holdout, so with awq+gptq both guards judge on the same samples. Samples are
counted in the whole calibration set (distributed.global_index), so under torchrun every rank holds out the
samples one process would, wherever they landed. Imports no torch at module level: the recipe schema reads
HOLDOUT from here.
"""
from __future__ import annotations

# 0.1: the share GPTQ's guard was measured with (on prose calibration it took the code text from -58% to -22%
# of the RTN gap, docs/benchmarks-history.md "Across domains"); AWQ's guard was measured only on (0.2) against
# off, within the noise of those tables, and learned rounding's 0.125 never against another share. Beside GPTQ's
# decorrelation prior they still earn their time: without them AWQ+GPTQ was worse in-domain beyond the noise in 3
# of 6 calib_size cells and better in none (docs/benchmarks-history.md, "The hold-out guards beside the prior")
HOLDOUT = 0.1


def held_out_count(samples: int, fraction: float) -> int:
    """How many of the last calibration samples are held out: round(samples * fraction), at least one when the
    fraction is positive, never all of them (and none from a single sample)."""
    if fraction <= 0 or samples < 2:
        return 0
    return min(samples - 1, max(1, round(samples * fraction)))


def split(n: int, fraction: float) -> tuple[list[int], list[int] | None]:
    """(kept, held) indices of this process's N samples: held are those among the last held_out_count of the
    whole calibration set (every rank's samples together). held is None when no sample is held out anywhere,
    and may be empty on a rank whose share holds none while others do (it must still join the guard's pooling).
    A collective call under torchrun: every rank makes it."""
    from ..distributed import Pool

    n_all = Pool.count(n)
    k = held_out_count(n_all, fraction)
    if not k:
        return list(range(n)), None
    held = [j for j in range(n) if Pool.index(j) >= n_all - k]
    return [j for j in range(n) if Pool.index(j) < n_all - k], held
