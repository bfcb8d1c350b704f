"""The RL loop's rollout workers: one engine per local replica, the weight hand-off, and the gather.

Replicas are the mesh's sub-meshes along `data` (sharding.replica_meshes). The trainer's
parameters are sharded over (fsdp, tensor) and replicated over data, so each replica's devices
already hold the shards its engine needs: the hand-off re-wraps those buffers with the replica's
sharding (no copy, no recompilation; engine.update_weights keeps every program). With mixed
precision (model.rollout_dtype bfloat16 over float32 master weights, which the trainer may split
along data too) the hand-off first casts the parameters in one program whose output has that
replicated layout (`params`): each replica then re-wraps its shards of the cast copy. Requests are
split over the replicas by group; on several processes each runs its own replicas and the
completions are all-gathered, so every process ends the rollout with all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from fastrl_jax.config import Config
from fastrl_jax.models.decoder import DTYPES, cast_floating
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.rollout.engine import Completion, Request, RolloutEngine
from fastrl_jax.rollout.history import HistoryStore
from fastrl_jax.rollout.stats import RolloutStats, StrategyStats
from fastrl_jax.sharding import (
    allgather_json,
    host_allgather,
    local_replicas,
    replica_meshes,
    reshard,
    shardings_for,
)

_FINISH = ("stop", "length", "error")


@dataclasses.dataclass
class Replica:
    index: int
    mesh: Mesh
    shardings: Any  # pure dict of NamedSharding, the policy on this replica
    engine: RolloutEngine


def request_seed(seed: int, step: int, index: int) -> int:
    """Sampling seed of request `index` of RL step `step` (independent of the replica that runs it)."""
    return int(np.random.SeedSequence([seed, step, index]).generate_state(1)[0])


class RolloutWorkers:
    """The local replicas' engines; `generate` runs this process's share and returns every completion."""

    def __init__(self, cfg: Config, graphdef, params: dict, mesh: Mesh, drafter: Drafter | None,
                 history: HistoryStore | None = None, progress: bool = False, drafter_accept: float = math.inf,
                 keep_hidden: bool = False, shared_prefix: int | None = None):
        """drafter_accept: the drafter's estimated tokens per step so far (RolloutEngine.set_drafter_accept).
        keep_hidden: local completions carry the policy's hidden states (the online drafter trainer's data).
        shared_prefix: the prompt prefix the rollouts share (RolloutEngine's: warmed up, and the most a stream skips)."""
        self.graphdef = graphdef
        self.dtype = DTYPES[cfg.model.engine_dtype]
        self.num_replicas = mesh.shape["data"]
        abstract = nnx.state(nnx.eval_shape(lambda: nnx.merge(graphdef, params)))
        # The engines' layout on the whole mesh: replicated along data, split over (fsdp, tensor).
        self._cast = jax.jit(functools.partial(cast_floating, dtype=self.dtype),
                             out_shardings=nnx.to_pure_dict(shardings_for(abstract, mesh)))
        params = self._engine_params(params)
        self.head_params = policy_head(params)
        drafter = cast_floating(drafter, self.dtype) if drafter is not None else None
        self.replicas: list[Replica] = []
        subs = replica_meshes(mesh)
        for i in local_replicas(mesh):  # this process's
            sub = subs[i]
            shardings = nnx.to_pure_dict(shardings_for(abstract, sub))
            model = nnx.merge(graphdef, reshard(params, shardings))
            local_drafter = None
            if drafter is not None:
                d_graph, d_state = nnx.split(drafter)
                local_drafter = nnx.merge(d_graph, jax.device_put(d_state, shardings_for(d_state, sub)))
            engine = RolloutEngine(model, cfg.rollout, sd=cfg.sd, drafter=local_drafter, progress=progress, history=history,
                                   drafter_accept=drafter_accept, keep_hidden=keep_hidden, shared_prefix=shared_prefix)
            self.replicas.append(Replica(i, sub, shardings, engine))
        self.local_stats = RolloutStats()  # the last generate's stats of this process's replicas alone

    def update_weights(self, params: dict) -> None:
        """Hands new policy parameters to every local engine, in the engines' dtype (no recompilation)."""
        params = self._engine_params(params)
        self.head_params = policy_head(params)
        for r in self.replicas:
            r.engine.update_weights(nnx.merge(self.graphdef, reshard(params, r.shardings)))

    def _engine_params(self, params: dict) -> dict:
        """The trainer's parameters as the engines take them: the same buffers when the dtypes agree
        (the trainer then keeps them replicated along data), else a cast copy in the engines' layout."""
        if all(x.dtype == self.dtype or not jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(params)):
            return params
        return self._cast(params)

    def update_drafter(self, drafter: Drafter, accept: float = math.nan) -> None:
        """New drafter weights for every local engine, with their estimated tokens per step when known."""
        d_graph, d_state = nnx.split(cast_floating(drafter, self.dtype))
        for r in self.replicas:
            r.engine.update_drafter(nnx.merge(d_graph, jax.device_put(d_state, shardings_for(d_state, r.mesh))), accept)

    def controller_state(self) -> dict[str, dict]:
        """Every replica's adaptive-SD bandit (StrategyChooser.state), by replica index. On several processes
        every process must call it (a collective): a checkpoint's JSON is written by process 0 alone."""
        states = {str(r.index): r.engine.chooser.state() for r in self.replicas if r.engine.chooser is not None}
        if jax.process_count() > 1:
            states = {k: v for part in allgather_json(states) for k, v in part.items()}
        return states

    def restore_controller(self, states: dict[str, dict]) -> None:
        """Continues the local engines' bandits from controller_state() (replicas it lacks start cold)."""
        for r in self.replicas:
            if r.engine.chooser is not None and str(r.index) in states:
                r.engine.chooser.restore(states[str(r.index)])

    def generate(self, requests: Sequence[Request], group_size: int, *,
                 replica_done: Callable[[int], None] | None = None,
                 between_steps: Callable[[int], None] | None = None) -> tuple[list[Completion], RolloutStats]:
        """All completions (in request order) and the summed stats of every replica, all processes'.

        Group g (requests g*group_size ...) goes to replica g % num_replicas. replica_done(index) runs
        as soon as a local replica has finished its share (its devices are idle from then on);
        between_steps goes to every engine (RolloutEngine.generate).
        """
        owner = [(i // group_size) % self.num_replicas for i in range(len(requests))]

        def run(r: Replica):
            mine = [i for i in range(len(requests)) if owner[i] == r.index]
            out = r.engine.generate([requests[i] for i in mine], between_steps) if mine else []
            if replica_done is not None:
                replica_done(r.index)
            return mine, out, r.engine.stats if mine else RolloutStats()

        if len(self.replicas) == 1:
            results = [run(self.replicas[0])]
        else:  # JAX releases the GIL while a program runs, so replicas decode concurrently
            with ThreadPoolExecutor(len(self.replicas)) as pool:
                results = list(pool.map(run, self.replicas))
        completions: list[Completion | None] = [None] * len(requests)
        stats = RolloutStats()
        for mine, out, st in results:
            for i, c in zip(mine, out):
                completions[i] = c
            stats += st
        self.local_stats = stats
        if jax.process_count() > 1:
            completions = _allgather(completions, requests, owner, self.num_replicas)
            stats = _allgather_stats(stats)  # the step's metrics (logged by process 0) cover every replica
        return completions, stats


def policy_head(params: dict) -> dict:
    """A policy's pure dict with zero-length layer arrays: the embedding, final norm and head, all the online
    drafter trainer reads of it (merged with the policy's graphdef). Unrolled engines hold per-layer copies of
    the layers, so the stacked copy a hand-off cast for them would otherwise stay beside those (7.3 GiB a
    device at 32B)."""
    return params | {"layers": jax.tree.map(lambda a: a[:0], params["layers"])}


def _allgather(local: list[Completion | None], requests, owner, num_replicas) -> list[Completion]:
    """Every process's completions on every process (fixed-size arrays through host_allgather, error
    messages as JSON), the same on every process; those this process generated keep their hidden_states."""
    n = len(requests)
    width = max(r.max_new_tokens for r in requests)
    tokens = np.zeros((n, width), np.int32)
    logprobs = np.zeros((n, width), np.float32)
    lengths = np.zeros(n, np.int32)
    finish = np.zeros(n, np.int32)
    have = np.zeros(n, np.int32)
    for i, c in enumerate(local):
        if c is not None:
            tokens[i, : len(c.tokens)] = c.tokens
            logprobs[i, : len(c.logprobs)] = c.logprobs
            lengths[i], finish[i], have[i] = len(c.tokens), _FINISH.index(c.finish_reason), 1
    g = host_allgather((tokens, logprobs, lengths, finish, have))
    errors = {k: v for part in allgather_json({str(i): c.error for i, c in enumerate(local) if c and c.error})
              for k, v in part.items()}
    out = []
    for i in range(n):
        p = int(np.argmax(g[4][:, i]))
        if not g[4][p, i]:
            raise RuntimeError(f"request {i} was generated by no process (replica {owner[i]} of {num_replicas})")
        k = int(g[2][p, i])
        out.append(Completion(g[0][p, i, :k].tolist(), g[1][p, i, :k].tolist(), _FINISH[int(g[3][p, i])],
                              errors.get(str(i)), local[i].hidden_states if local[i] is not None else None))
    return out


def _allgather_stats(stats: RolloutStats) -> RolloutStats:
    """The sum of every process's stats, in process order (the same floats on every process)."""
    fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    fields["strategies"] = {k: dataclasses.astuple(v) for k, v in stats.strategies.items()}
    total = RolloutStats()
    for d in allgather_json(fields):
        total += RolloutStats(**d | {"calls": Counter(d["calls"]), "seconds": Counter(d["seconds"]),
                                     "strategies": {k: StrategyStats(*v) for k, v in d["strategies"].items()}})
    return total
