"""`fastrl-jax export-drafter` as a script: python scripts/export_drafter.py [args] (see --help)."""

import sys

from fastrl_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["export-drafter", *sys.argv[1:]]))
