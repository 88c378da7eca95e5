"""Llama-family model and its weight loaders."""
