"""Rollout: sampling, the compiled-program pool, and the engine that generates RL rollouts."""

from fastrl_jax.rollout.engine import Completion, Request, RolloutEngine

__all__ = ["Completion", "Request", "RolloutEngine"]
