"""The adaptive speculative-decoding controller: when SD runs, and with which draft-tree strategy.

Pure host-side logic, no JAX. The engine asks it once per host step (one program call):
- `OnOff` turns SD on when the live batch has stayed at or below a threshold for `patience`
  consecutive host steps, and off as soon as it is above (hysteresis: a batch hovering around the
  threshold cannot flip SD on and off every step, and each switch on costs a drafter prefill).
- `StrategyChooser` picks a strategy for the live batch. Strategies are grouped by verify_tokens
  and each group owns a live-batch range (big trees for small batches, where verifying extra
  tokens is nearly free). Inside the group: 'beg' (bucketed epsilon-greedy on the median reward
  over a sliding window, TLT's BEG), 'ucb1' (UCB1 on the windowed mean), or 'fixed' (the group's
  first strategy). Reward = accepted tokens x live batch / step seconds, i.e. tokens per second.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from fastrl_jax.rollout.speculative import Strategy

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
      strategies: the candidate trees.
      ranges: {verify_tokens: (min_live_batch, max_live_batch)}, one disjoint range per group.
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
    ):
        if kind not in BANDITS:
            raise ValueError(f"bandit kind must be one of {BANDITS}, got {kind!r}")
        groups: dict[int, list[Strategy]] = {}
        for s in strategies:
            groups.setdefault(s.verify_tokens, []).append(s)
        if set(groups) != set(ranges):
            raise ValueError(f"need one live-batch range per verify_tokens group {sorted(groups)}, got {sorted(ranges)}")
        spans = sorted(ranges.values())
        if any(lo < 1 or hi < lo for lo, hi in spans) or any(a[1] >= b[0] for a, b in zip(spans, spans[1:])):
            raise ValueError(f"live-batch ranges must be disjoint [min, max] with 1 <= min <= max, got {ranges}")
        self.groups, self.ranges, self.kind, self.epsilon = groups, ranges, kind, epsilon
        self.rewards: dict[Strategy, deque[float]] = {s: deque(maxlen=window) for s in strategies}
        self.pulls: dict[Strategy, int] = {s: 0 for s in strategies}
        self.rng = np.random.default_rng(seed)

    def group(self, live_batch: int) -> list[Strategy] | None:
        """The strategies whose range holds live_batch, or None when no group covers it."""
        for verify, (lo, hi) in self.ranges.items():
            if lo <= live_batch <= hi:
                return self.groups[verify]
        return None

    def choose(self, live_batch: int) -> Strategy | None:
        arms = self.group(live_batch)
        if arms is None:
            return None
        if self.kind == "fixed" or len(arms) == 1:
            return arms[0]
        untried = [s for s in arms if not self.rewards[s]]
        if untried:
            return untried[0]
        if self.kind == "beg":
            if self.rng.random() < self.epsilon:
                return arms[int(self.rng.integers(len(arms)))]
            return max(arms, key=lambda s: float(np.median(self.rewards[s])))
        total = sum(self.pulls[s] for s in arms)
        scale = max(max(self.rewards[s]) for s in arms) or 1.0  # UCB1 wants rewards in [0, 1]

        def ucb(s: Strategy) -> float:
            return float(np.mean(self.rewards[s])) / scale + math.sqrt(2 * math.log(total) / self.pulls[s])

        return max(arms, key=ucb)

    def record(self, strategy: Strategy, reward: float) -> None:
        """reward: tokens per second of one host step run with `strategy`."""
        self.rewards[strategy].append(reward)
        self.pulls[strategy] += 1

