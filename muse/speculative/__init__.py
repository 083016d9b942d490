"""Speculative decoding: drafts proposed cheaply, verified losslessly by the target."""
