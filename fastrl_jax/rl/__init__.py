"""GRPO training: prompt pipelines, rewards, the GRPO loss, the policy update and the RL loop."""
