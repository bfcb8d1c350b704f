"""`fastrl-jax train-drafter` as a script: python scripts/train_drafter.py [args] (see --help)."""

import sys

from fastrl_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["train-drafter", *sys.argv[1:]]))
