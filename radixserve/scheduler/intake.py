"""Intake: a `GenerateReq` checked by `validation.check_generate` becomes the scheduler's `Req`:
its output room capped by the context and the pool, its radix namespace (cache salt and
adapter), its grammar matcher and its speculation state."""

from __future__ import annotations

from dataclasses import replace

from ..constrained import GrammarBackend, GrammarSpec
from ..lora import cache_namespace
from ..messages import GenerateReq
from ..multimodal.positions import mrope_positions
from ..sampling_params import SamplingParams
from ..worker_info import WorkerInfo
from .adapters import AdapterTable
from .req import Req
from .speculative import SpecState


class Intake:
    def __init__(
        self,
        info: WorkerInfo,
        num_slots: int,
        adapters: AdapterTable,
        grammars: GrammarBackend | None,
        speculative: bool,
        first_token_only: bool,
    ):
        """`first_token_only`: a prefill server of a disaggregated pair (the decode server makes
        the rest)."""
        self.max_len = min(info.max_context_len, num_slots)
        self.mrope_merge_size, self.whole_images = info.mrope_merge_size, info.whole_images
        self.adapters, self.grammars = adapters, grammars
        self.speculative, self.first_token_only = speculative, first_token_only

    def make(self, msg: GenerateReq) -> Req:
        """Raises ValueError for an unknown adapter or a grammar that does not compile."""
        room = self.max_len - len(msg.input_ids)
        if self.first_token_only:
            room = min(room, 1)
        params = msg.sampling_params
        params = replace(params, max_new_tokens=min(params.max_new_tokens, room))
        req = Req(
            msg.rid,
            list(msg.input_ids),
            params,
            msg.return_logprob,
            msg.logprob_start_len,
            msg.top_logprobs_num,
            priority=msg.priority,
            cache_salt=cache_namespace(msg.cache_salt, self.adapters.lookup(msg.lora_path)),
            pooling=msg.pooling,
            lora=msg.lora_path,
            bootstrap=msg.bootstrap,
            images=msg.images or None,
            whole_images=self.whole_images and bool(msg.images),
        )
        if req.images and self.mrope_merge_size:
            spans = [(im.offset, tuple(im.grid), im.time_interval) for im in req.images]
            req.mrope = mrope_positions(len(req.input_ids), spans, self.mrope_merge_size)
        req.grammar = self._grammar_matcher(params)
        if self.speculative:
            req.spec = SpecState()
        return req

    def _grammar_matcher(self, params: SamplingParams):
        spec = GrammarSpec.from_params(params)
        if spec is None:
            return None
        if self.grammars is None:
            raise ValueError(
                "structured output (regex, json_schema, ebnf) needs the model's tokenizer"
            )
        return self.grammars.matcher(spec)
