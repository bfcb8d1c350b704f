"""Built-in data: verifiable math problems used as RL and drafter-training prompts."""
