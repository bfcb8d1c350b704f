"""`python -m helpers.slow_gather SECONDS ARGS...`: the CLI with ARGS, where process 1 reaches each rollout's gather
SECONDS late (a long tail on its replicas), so process 0 waits there with its replicas idle."""

import sys
import time

import jax

from fastrl_jax import cli
from fastrl_jax.rl import workers


def main() -> int:
    seconds, gather = float(sys.argv[1]), workers._allgather

    def late(*args):
        if jax.process_index() == 1:
            time.sleep(seconds)
        return gather(*args)

    workers._allgather = late
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
