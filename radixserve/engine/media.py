"""The offline Engine's images and videos (`image_data`, `video_data`): each a data URL, a bare
base64 string, a `file://` URL or path of a local file, or raw bytes, preprocessed as the server
does (`multimodal.inputs.MediaInputs`: the same checks, the same processor cache). An http(s)
URL is the server's to fetch (`--allowed-media-domains`); the Engine does not fetch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..messages import ImageInput
from ..multimodal.inputs import MediaInputs, MediaPart, data_fields
from ..multimodal.media import MediaPolicy, is_remote, local_bytes
from ..multimodal.spec import VisionSpec

CACHE_BYTES = 1 << 30  # preprocessed images and videos kept by the hash of their bytes

Data = str | bytes


class EngineMedia:
    def __init__(self, spec: VisionSpec | None, tokenizer: Any, max_tokens: int):
        # the caller's own files: any local path; no limit a prompt beyond the context
        policy = MediaPolicy(allowed_local_path="/")
        self.inputs = MediaInputs(spec, policy, {}, tokenizer, max_tokens, CACHE_BYTES)

    def attach(
        self,
        ids: list[int],
        image_data: Data | list[Data] | None,
        video_data: Data | list[Data] | None,
    ) -> tuple[list[int], list[ImageInput] | None]:
        """The prompt's ids with its images' and videos' markers expanded, and their inputs.
        ValueError (`MediaError`) naming the part."""
        fields = data_fields(image_data, video_data)
        blobs = [item for _, _, item in fields]
        parts = [
            MediaPart(item if isinstance(item, str) else "", where, kind=kind)
            for kind, where, item in fields
        ]
        self.inputs.check(parts)
        media = [
            self.inputs.process(self._bytes(blob, part), part) for blob, part in zip(blobs, parts)
        ]
        return self.inputs.attach(ids, media)

    def _bytes(self, item: Data, part: MediaPart) -> bytes:
        if isinstance(item, bytes):
            return item
        if not isinstance(item, str):
            raise ValueError(f"{part.where}: pass a data URL, base64, a file path or bytes")
        if is_remote(item):
            raise ValueError(
                f"{part.where}: the offline Engine does not fetch http(s) URLs; pass the bytes"
            )
        if "://" not in item[:12] and not item.startswith("data:") and Path(item).is_file():
            item = Path(item).resolve().as_uri()
        return local_bytes(item, self.inputs.policy, part.where, part.kind)
