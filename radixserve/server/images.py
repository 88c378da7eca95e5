"""The api process's side of images and videos: each request part fetched (aiohttp, allowed
hosts only) or read, then decoded and preprocessed off the event loop, on two threads at the
lowest CPU priority (`multimodal.inputs.MediaInputs`), and put into the prompt as its
content-hash tokens. Every failure is a 400 naming the part; a failed image or video fails its
request alone."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from ..messages import ImageInput
from ..multimodal.inputs import MediaInputs, MediaPart
from ..multimodal.media import MediaError, fetch_bytes, is_remote, local_bytes
from ..multimodal.processing import Media
from .http import RequestError
from .tokenizing import lower_this_threads_priority


class ImageInputs(MediaInputs):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # at the lowest CPU priority, as long tokenizations: decoding a large image must not
        # take a core from the scheduler's threads or the event loop
        self.pool = ThreadPoolExecutor(
            2, thread_name_prefix="images", initializer=lower_this_threads_priority
        )

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, parts: list[MediaPart]) -> list[Media]:
        """Each part's image or video, preprocessed, in order."""
        if not parts:
            return []
        try:
            self.check(parts)
            fetched = await asyncio.gather(
                *(
                    fetch_bytes(p.url, self.policy, p.where, p.kind)
                    for p in parts
                    if is_remote(p.url)
                )
            )
            remote = iter(fetched)
            loop = asyncio.get_running_loop()
            return list(
                await asyncio.gather(
                    *(
                        loop.run_in_executor(
                            self.pool, self._read, next(remote) if is_remote(p.url) else None, p
                        )
                        for p in parts
                    )
                )
            )
        except MediaError as exc:
            raise RequestError(str(exc)) from None

    def _read(self, data: bytes | None, part: MediaPart) -> Media:
        """On a pool thread: the bytes (unless fetched), then what they are."""
        if data is None:
            data = local_bytes(part.url, self.policy, part.where, part.kind)
        return self.process(data, part)

    def attach(
        self, ids: list[int], media: list[Media]
    ) -> tuple[list[int], list[ImageInput] | None]:
        try:
            return super().attach(ids, media)
        except MediaError as exc:
            raise RequestError(str(exc)) from None
