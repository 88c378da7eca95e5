"""The data-parallel router: an HTTP proxy in front of radixserve (or SGLang) workers."""
