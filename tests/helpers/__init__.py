"""Helpers the tests share: tiny models, the plain greedy oracle, tiny GRPO runs, the CLI runner."""
