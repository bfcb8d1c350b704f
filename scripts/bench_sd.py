"""`fastrl-jax bench-sd` as a script: python scripts/bench_sd.py [args] (see --help)."""

import sys

from fastrl_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-sd", *sys.argv[1:]]))
