"""Shared by the examples: a server URL from RADIXSERVE_URL, else an in-process engine."""

import os

from radixserve.lang import EngineBackend, RuntimeEndpoint


def backend():
    url = os.environ.get("RADIXSERVE_URL")
    if url:
        return RuntimeEndpoint(url, api_key=os.environ.get("RADIXSERVE_API_KEY"))
    from radixserve import Engine

    return EngineBackend(Engine(max_total_tokens=16384))
