"""The HTTP server: api process, tokenizer manager, OpenAI adapter, metrics, launch."""
