#!/usr/bin/env python
"""GRPO training: the same as `fastrl-jax train` (see `--help`).

    python scripts/train_grpo.py --config configs/smollm2_cpu.yaml rl.steps=20 [--resume] [--dry-run]
"""

import sys

from fastrl_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
