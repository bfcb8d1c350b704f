"""`python -m helpers.slow_gather SECONDS ARGS...`: the CLI with ARGS, where process 0 reaches each rollout's gather
SECONDS late (a long tail on its replicas), so process 1 waits there with its replicas idle; at the end each process
prints a digest of its online drafter ("drafter digest HEX", stderr)."""

import hashlib
import sys
import time

import jax
import numpy as np

from fastrl_jax import cli
from fastrl_jax.rl import trainer, workers


def main() -> int:
    seconds, gather, close = float(sys.argv[1]), workers._allgather, trainer.Trainer.close

    def late(*args):
        if jax.process_index() == 0:
            time.sleep(seconds)
        return gather(*args)

    def digest_then_close(self):
        if self.spot is not None:
            h = hashlib.sha256()
            for leaf in jax.tree.leaves((self.spot.params, self.spot.opt_state)):
                h.update(np.asarray(leaf).tobytes())
            print(f"drafter digest {h.hexdigest()}", file=sys.stderr)
        close(self)

    workers._allgather, trainer.Trainer.close = late, digest_then_close
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
