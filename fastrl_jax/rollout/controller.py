"""The adaptive speculative-decoding controller: when SD runs, and with which draft-tree strategy.

Pure host-side logic, no JAX. The engine asks it once per host step (one program call):
- `OnOff` turns SD on when the live batch has stayed at or below a threshold for `patience`
  consecutive host steps, and off as soon as it is above (hysteresis: a batch hovering around the
  threshold cannot flip SD on and off every step, and each switch on costs a drafter prefill).
- `StrategyChooser` picks a strategy for the live batch. Strategies are grouped by the tokens a step
  verifies and each group owns a live-batch range (big trees for small batches, where verifying
  extra tokens is nearly free). Plain decoding (speculative.PLAIN) can be an arm of every group, so
  speculation that does not pay (a random drafter, text unlike any history) loses to it. Inside the
  group: 'beg' (bucketed epsilon-greedy on the median reward over a sliding window, TLT's BEG),
  'ucb1' (UCB1 on the windowed mean), or 'fixed' (the group's first strategy). Reward = tokens
  emitted / seconds, i.e. tokens per second, the drafter prefill a switch needed included.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from fastrl_jax.rollout.speculative import PLAIN, Strategy

BANDITS = ("beg", "ucb1", "fixed")


class OnOff:
    """SD on after `patience` consecutive host steps with live batch <= threshold; off when above."""

    def __init__(self, threshold: int, patience: int):
        if threshold < 1 or patience < 1:
            raise ValueError(f"need threshold >= 1 and patience >= 1, got {threshold}, {patience}")
        self.threshold, self.patience = threshold, patience
        self.below = 0  # consecutive host steps at or below the threshold

    def update(self, live_batch: int) -> bool:
        """Records one host step's live batch; returns whether SD runs this step."""
        self.below = self.below + 1 if live_batch <= self.threshold else 0
        return self.below >= self.patience

    def reset(self) -> None:
        self.below = 0


class StrategyChooser:
    """Bucketed bandit over draft-tree strategies.

    Args:
      strategies: the candidate strategies (PLAIN excluded).
      ranges: {verified tokens: (min_live_batch, max_live_batch)}, one disjoint range per group.
      kind: 'beg', 'ucb1' or 'fixed'.
      epsilon: exploration probability of 'beg'.
      window: rewards per strategy kept (the sliding window).
      seed: the exploration RNG's seed; the same seed and rewards give the same choices.
    """

    def __init__(
        self,
        strategies: Sequence[Strategy],
        ranges: dict[int, tuple[int, int]],
        kind: str = "beg",
        epsilon: float = 0.1,
        window: int = 16,
        seed: int = 0,
        plain_arm: bool = False,
    ):
        if kind not in BANDITS:
            raise ValueError(f"bandit kind must be one of {BANDITS}, got {kind!r}")
        groups: dict[int, list[Strategy]] = {}
        for s in strategies:
            groups.setdefault(s.num_nodes, []).append(s)
        if set(groups) != set(ranges):
            raise ValueError(f"need one live-batch range per verify_tokens group {sorted(groups)}, got {sorted(ranges)}")
        spans = sorted(ranges.values())
        if any(lo < 1 or hi < lo for lo, hi in spans) or any(a[1] >= b[0] for a, b in zip(spans, spans[1:])):
            raise ValueError(f"live-batch ranges must be disjoint [min, max] with 1 <= min <= max, got {ranges}")
        if plain_arm:
            groups = {n: [*arms, PLAIN] for n, arms in groups.items()}
        self.groups, self.ranges, self.kind, self.epsilon = groups, ranges, kind, epsilon
        # PLAIN's rewards are kept per group: what plain decoding earns depends on the live batch.
        self.rewards: dict[tuple[int, Strategy], deque[float]] = {
            (n, s): deque(maxlen=window) for n, arms in groups.items() for s in arms}
        self.pulls: dict[tuple[int, Strategy], int] = {key: 0 for key in self.rewards}
        self.rng = np.random.default_rng(seed)

    def group(self, live_batch: int) -> int | None:
        """The group (its verified tokens) whose range holds live_batch, or None when none covers it."""
        for nodes, (lo, hi) in self.ranges.items():
            if lo <= live_batch <= hi:
                return nodes
        return None

    def choose(self, live_batch: int) -> Strategy | None:
        n = self.group(live_batch)
        if n is None:
            return None
        arms = self.groups[n]
        if self.kind == "fixed" or len(arms) == 1:
            return arms[0]
        untried = [s for s in arms if not self.rewards[n, s]]
        if untried:
            return untried[0]
        if self.kind == "beg":
            if self.rng.random() < self.epsilon:
                return arms[int(self.rng.integers(len(arms)))]
            return max(arms, key=lambda s: float(np.median(self.rewards[n, s])))
        total = sum(self.pulls[n, s] for s in arms)
        scale = max(max(self.rewards[n, s]) for s in arms) or 1.0  # UCB1 wants rewards in [0, 1]

        def ucb(s: Strategy) -> float:
            return float(np.mean(self.rewards[n, s])) / scale + math.sqrt(2 * math.log(total) / self.pulls[n, s])

        return max(arms, key=ucb)

    def record(self, strategy: Strategy, live_batch: int, reward: float) -> None:
        """reward: tokens per second of one host step run with `strategy` at `live_batch` live rows."""
        n = self.group(live_batch)
        if n is not None and (n, strategy) in self.rewards:
            self.rewards[n, strategy].append(reward)
            self.pulls[n, strategy] += 1
