"""Evaluation of a model through the serving engine (`muse eval`): held-out arithmetic, tool
calls, short instructions, reply format, and next-token loss on held-out Python source."""
