"""What a rollout did: token and step counters, seconds per phase, acceptance per draft-tree strategy,
and a timeline of its program calls. `+` sums rollouts (replicas of one RL step, rounds of a benchmark).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import NamedTuple


class Call(NamedTuple):
    """One program call of a rollout's decode loop, as the timeline records it."""

    end_s: float  # seconds since the rollout started, at the call's end
    live: int  # live rows during the call
    tokens: int  # tokens the call emitted
    speculative: bool
    strategy: str  # the draft strategy's label; '' for plain decoding
    seconds: float = 0.0  # the program's own time (end_s also counts the host work before it)
    kv_len: int = 0  # cache slots attention read (the length bucket)
    batch: int = 0  # rows of the table (the batch bucket)
    steps: int = 0  # device steps the call ran


@dataclasses.dataclass
class StrategyStats:
    """Speculative steps of one draft-tree strategy."""

    tokens: int = 0  # tokens its steps emitted
    steps: int = 0  # row-steps (one live row, one speculative step)
    seconds: float = 0.0  # its program calls' wall time

    def __add__(self, other: StrategyStats) -> StrategyStats:
        return StrategyStats(self.tokens + other.tokens, self.steps + other.steps, self.seconds + other.seconds)


@dataclasses.dataclass
class RolloutStats:
    """Counters and seconds of one rollout (or the sum of several)."""

    tokens: int = 0  # completion tokens of the finished requests
    steps_plain: int = 0  # plain decode steps on device (each call counts its longest row's)
    steps_sd: int = 0  # speculative steps on device (likewise)
    sd_tokens: int = 0  # tokens emitted by speculative steps
    sd_steps: int = 0  # speculative row-steps
    idle_row_steps: int = 0  # device steps finished rows waited for their refill (streaming)
    prompt_tokens: int = 0  # distinct prompt tokens prefilled (after a stream's shared prefix)
    prompt_slots: int = 0  # tokens the prefill packs ran: prompt_tokens and the padding to prompt buckets
    drafts_eagle: int = 0  # emitted tokens the EAGLE drafter had drafted
    drafts_history: int = 0  # emitted tokens drafted from history (a draft both proposed counts twice)
    # Seconds speculative calls saved against plain steps of the same table (negative: they cost more),
    # from the latest plain call's seconds per step at that batch and length bucket.
    sd_saved_s: float = 0.0
    calls: Counter = dataclasses.field(default_factory=Counter)  # program calls per phase
    # Seconds per program phase (prefill, decode, decode_admit, sd, draft_prefill, resize), plus 'compile' (programs
    # compiled during the rollout), 'host' (the rest of the loop) and 'total' (wall time).
    seconds: Counter = dataclasses.field(default_factory=Counter)
    strategies: dict[str, StrategyStats] = dataclasses.field(default_factory=dict)  # by strategy label

    def __add__(self, other: RolloutStats) -> RolloutStats:
        labels = self.strategies.keys() | other.strategies.keys()
        return RolloutStats(
            tokens=self.tokens + other.tokens, steps_plain=self.steps_plain + other.steps_plain,
            idle_row_steps=self.idle_row_steps + other.idle_row_steps,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens, prompt_slots=self.prompt_slots + other.prompt_slots,
            steps_sd=self.steps_sd + other.steps_sd, sd_tokens=self.sd_tokens + other.sd_tokens,
            sd_steps=self.sd_steps + other.sd_steps, drafts_eagle=self.drafts_eagle + other.drafts_eagle,
            drafts_history=self.drafts_history + other.drafts_history, sd_saved_s=self.sd_saved_s + other.sd_saved_s,
            calls=_sum(self.calls, other.calls),
            seconds=_sum(self.seconds, other.seconds),
            strategies={k: self.strategies.get(k, StrategyStats()) + other.strategies.get(k, StrategyStats()) for k in labels},
        )

    def acceptance_length(self, label: str = "") -> float:
        """Tokens per speculative row-step, of all strategies or of the one labelled `label`; NaN
        without speculative steps."""
        if label:
            s = self.strategies.get(label, StrategyStats())
            tokens, steps = s.tokens, s.steps
        else:
            tokens, steps = self.sd_tokens, self.sd_steps
        return tokens / steps if steps else float("nan")

    def acceptance_by_strategy(self) -> dict[str, float]:
        return {label: self.acceptance_length(label) for label, s in self.strategies.items() if s.steps}

    def drafts_per_step(self) -> dict[str, float]:
        """Emitted drafted tokens per speculative row-step, by the drafter that proposed them."""
        if not self.sd_steps:
            return {"eagle": float("nan"), "history": float("nan")}
        return {"eagle": self.drafts_eagle / self.sd_steps, "history": self.drafts_history / self.sd_steps}

    def as_dict(self) -> dict:
        """Plain JSON-able values, acceptance lengths included."""
        out = dataclasses.asdict(self)
        out["calls"], out["seconds"] = dict(self.calls), dict(self.seconds)
        out["acceptance_length"] = self.acceptance_length()
        out["acceptance_by_strategy"] = self.acceptance_by_strategy()
        out["drafts_per_step"] = self.drafts_per_step()
        return out


def _sum(a: Counter, b: Counter) -> Counter:
    """a + b key by key, keeping zero entries (Counter's + drops those: a phase at 0 s would vanish from a sum)."""
    out = Counter(a)
    out.update(b)
    return out


class Recorder:
    """Collects one rollout's stats and timeline while the engine runs it."""

    def __init__(self, compile_seconds: float):
        self.stats = RolloutStats()
        self.timeline: list[Call] = []
        self.start = time.perf_counter()
        self._compile_seconds = compile_seconds

    def timed(self, phase: str, seconds: float) -> None:
        self.stats.calls[phase] += 1
        self.stats.seconds[phase] += seconds

    def decode_call(self, live: int, tokens: int, device_steps: int, seconds: float, kv_len: int, batch: int) -> None:
        self.stats.steps_plain += device_steps
        self.timeline.append(Call(self.elapsed(), live, tokens, False, "", seconds, kv_len, batch, device_steps))

    def sd_call(self, label: str, live: int, tokens: int, row_steps: int, device_steps: int, seconds: float,
                drafts_eagle: int, drafts_history: int, kv_len: int, batch: int) -> None:
        s = self.stats
        s.steps_sd += device_steps
        s.sd_tokens += tokens
        s.sd_steps += row_steps
        s.drafts_eagle += drafts_eagle
        s.drafts_history += drafts_history
        s.strategies[label] = s.strategies.get(label, StrategyStats()) + StrategyStats(tokens, row_steps, seconds)
        self.timeline.append(Call(self.elapsed(), live, tokens, True, label, seconds, kv_len, batch, device_steps))

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def finish(self, compile_seconds: float) -> RolloutStats:
        """The stats, with the compile seconds since the start (pool total now - at the start)."""
        s = self.stats
        phases = sum(s.seconds.values())
        s.seconds["compile"] = compile_seconds - self._compile_seconds
        s.seconds["total"] = self.elapsed()
        s.seconds["host"] = s.seconds["total"] - phases - s.seconds["compile"]
        return s
