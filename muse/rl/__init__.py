"""GRPO training pieces: loss math, rewards, tool environment and task generators."""
