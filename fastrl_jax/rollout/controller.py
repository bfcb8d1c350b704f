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
  emitted per second per live row (comparable across the live batches of a bucket), the drafter
  prefill a switch needed included. Arms that draft with the EAGLE drafter sit out while the
  drafter's estimated tokens per step (`drafter_accept`, set by its owner) is below
  `min_drafter_accept`: a randomly initialised drafter would only cost their compiles and explorations.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict, deque
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
    """Bucketed bandit over draft strategies (and plain decoding).

    Args:
      strategies: the candidate strategies (PLAIN excluded).
      ranges: {verified tokens: (min_live_batch, max_live_batch)}, one range per group; ranges may
        overlap, and a live batch's arms are those of every group whose range holds it.
      kind: 'beg', 'ucb1' or 'fixed'.
      epsilon: exploration probability of 'beg'.
      window: rewards per strategy kept (the sliding window).
      seed: the exploration RNG's seed; the same seed and rewards give the same choices.
      plain_arm: plain decoding is an arm wherever a group's range holds the live batch.
      min_drafter_accept: EAGLE arms compete only while drafter_accept (inf until told: a trained
        drafter is trusted) is at least this.
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
        min_drafter_accept: float = 0.0,
    ):
        if kind not in BANDITS:
            raise ValueError(f"bandit kind must be one of {BANDITS}, got {kind!r}")
        groups: dict[int, list[Strategy]] = {}
        for s in strategies:
            groups.setdefault(s.num_nodes, []).append(s)
        if set(groups) != set(ranges):
            raise ValueError(f"need one live-batch range per verify_tokens group {sorted(groups)}, got {sorted(ranges)}")
        if any(lo < 1 or hi < lo for lo, hi in ranges.values()):
            raise ValueError(f"live-batch ranges must be [min, max] with 1 <= min <= max, got {ranges}")
        self.strategies, self.ranges, self.kind, self.epsilon, self.plain_arm = list(strategies), ranges, kind, epsilon, plain_arm
        self.min_drafter_accept, self.drafter_accept = min_drafter_accept, math.inf
        self.window = window
        self.forget(seed)

    def forget(self, seed: int = 0) -> None:
        """Forgets every reward and pull and reseeds exploration: a cold start over the same arms (the
        drafter's estimate stays)."""
        # Rewards per bucket (the groups covering a live batch): what an arm earns depends on the live batch.
        self.rewards: dict[tuple[tuple[int, ...], Strategy], deque[float]] = defaultdict(lambda: deque(maxlen=self.window))
        self.pulls: Counter = Counter()
        self.rng = np.random.default_rng(seed)
        self.exploring = False  # whether the last choice was exploration (untried or random), not the best arm

    def forget_drafter_arms(self) -> None:
        """Forgets what the arms drafting with the EAGLE drafter earned (new drafter weights: they earn anew, and
        each is tried again where it competes, instead of waiting for exploration to find it better)."""
        for table in (self.rewards, self.pulls):
            for key in [k for k in table if k[1].uses_drafter]:
                del table[key]

    def state(self) -> dict:
        """What the bandit has learned (rewards, pulls, the exploration RNG), JSON-able, for checkpoints."""
        return {"rewards": [[list(b), s.label, list(r)] for (b, s), r in self.rewards.items() if r],
                "pulls": [[list(b), s.label, n] for (b, s), n in self.pulls.items()],
                "rng": self.rng.bit_generator.state}

    def restore(self, state: dict) -> None:
        """Continues from state(); rewards of arms this chooser does not have are dropped."""
        self.forget()
        arms = {s.label: s for s in [*self.strategies, *[PLAIN] * self.plain_arm]}
        for b, label, rewards in state["rewards"]:
            if label in arms:
                self.rewards[tuple(b), arms[label]].extend(rewards)
        for b, label, n in state["pulls"]:
            if label in arms:
                self.pulls[tuple(b), arms[label]] = n
        self.rng.bit_generator.state = state["rng"]

    def bucket(self, live_batch: int) -> tuple[int, ...]:
        """The groups (by verified tokens) whose range holds live_batch; () when none does."""
        return tuple(sorted(n for n, (lo, hi) in self.ranges.items() if lo <= live_batch <= hi))

    def arms(self, bucket: tuple[int, ...]) -> list[Strategy]:
        """The bucket's arms in the order the strategies were given, then plain decoding."""
        drafter_ok = self.drafter_accept >= self.min_drafter_accept
        arms = [s for s in self.strategies if s.num_nodes in bucket and (drafter_ok or not s.uses_drafter)]
        return [*arms, PLAIN] if arms and self.plain_arm else arms

    def choose(self, live_batch: int) -> Strategy | None:
        b = self.bucket(live_batch)
        arms = self.arms(b)
        self.exploring = False
        if not arms:
            return None
        if self.kind == "fixed" or len(arms) == 1:
            return arms[0]
        untried = [s for s in arms if not self.rewards[b, s]]
        if untried:
            self.exploring = True
            return untried[0]
        if self.kind == "beg":
            best = max(arms, key=lambda s: float(np.median(self.rewards[b, s])))
            if self.rng.random() < self.epsilon:
                choice = arms[int(self.rng.integers(len(arms)))]
                self.exploring = choice != best
                return choice
            return best
        total = sum(self.pulls[b, s] for s in arms)
        scale = max(max(self.rewards[b, s]) for s in arms) or 1.0  # UCB1 wants rewards in [0, 1]

        def ucb(s: Strategy) -> float:
            return float(np.mean(self.rewards[b, s])) / scale + math.sqrt(2 * math.log(total) / self.pulls[b, s])

        return max(arms, key=ucb)

    def record(self, strategy: Strategy, live_batch: int, reward: float) -> None:
        """reward: tokens per second per live row of one host step run with `strategy` at `live_batch`.
        A reward that is not a finite number (a broken timing) is dropped: kept, one NaN or inf would decide
        the arm's median or UCB1's scale, and so the choices, until it left the window."""
        b = self.bucket(live_batch)
        if math.isfinite(reward) and strategy in self.arms(b):
            self.rewards[b, strategy].append(reward)
            self.pulls[b, strategy] += 1
