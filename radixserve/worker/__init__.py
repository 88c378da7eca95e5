"""Model worker: forward batches, attention metadata, sampling."""
