"""Continuous batching over the radix cache."""
