"""Training data made on the machine: Python source found locally and synthetic conversations.

Nothing is downloaded. Every generator is a pure function of a seed, and every example belongs
to the train or the held-out split by a hash of its key (`split.py`), so evaluation never sees
a training example however long training runs.
"""
