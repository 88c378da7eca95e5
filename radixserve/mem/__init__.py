"""Memory: slot allocator, request rows, radix prefix cache (scheduler side) and KV pool (worker
side)."""
