"""Sizing tools the CLI runs: trace replay over shadow caches (`cache_sim`), the what-if
replayer (`replay`, `radixserve replay`) and the memory plan report (`planning`, `radixserve
plan`)."""
