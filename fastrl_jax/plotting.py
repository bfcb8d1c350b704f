"""matplotlib for the benchmarks' PNGs, an optional extra (`pip install 'fastrl-jax[plot]'`)."""

from __future__ import annotations

import sys
from pathlib import Path


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
    """Writes `fig` to `path` whole or not at all (files.replacing) in the format its suffix names (PNG without
    one, as savefig would write it) and closes it."""
    import matplotlib.pyplot as plt

    from fastrl_jax import files

    with files.replacing(path) as tmp:  # the temporary name ends in '.tmp' without a suffix of the path's
        fig.savefig(tmp, **{"dpi": 120, "format": Path(path).suffix[1:].lower() or "png"} | savefig)
    plt.close(fig)
