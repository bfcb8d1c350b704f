"""matplotlib for the benchmarks' PNGs, an optional extra (`pip install 'fastrl-jax[plot]'`)."""

from __future__ import annotations

import sys


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (said on stderr) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib: no plot (pip install 'fastrl-jax[plot]')", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path, **savefig) -> None:
    """Writes `fig` to `path` whole or not at all (files.replacing; the temporary name keeps the suffix, from which
    savefig picks the format) and closes it."""
    import matplotlib.pyplot as plt

    from fastrl_jax import files

    with files.replacing(path) as tmp:
        fig.savefig(tmp, **{"dpi": 120} | savefig)
    plt.close(fig)
