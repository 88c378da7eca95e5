"""What a forward's results do to its requests: tokens and logprobs appended, drafts verified,
forced tokens jumped over, finish reasons set, and the outputs emitted."""

from __future__ import annotations

from typing import Callable

import torch

from ..config import EngineArgs
from ..constrained import GrammarBackend
from ..messages import FinishReason, ForwardResult, ReqOutput, TokenLogprobs
from ..sampling_params import compile_stop_regex
from .kv_manager import KVManager
from .metrics import SchedulerMetrics
from .req import Req

STOP_REGEX_WINDOW = 32  # output tokens a stop regex is matched against, counted from the end
GRAMMAR_DEAD_END = (
    "no token satisfies both the grammar and the other sampling constraints "
    "(stop_token_ids, min_new_tokens)"
)


class ResultProcessor:
    def __init__(
        self,
        args: EngineArgs,
        kv: KVManager,
        metrics: SchedulerMetrics,
        eos_ids: frozenset[int],
        decode_tail: Callable[[list[int]], str] | None,
        grammars: GrammarBackend | None,
    ):
        self.jump_forward = args.enable_jump_forward
        self.kv, self.metrics, self.stats = kv, metrics, metrics.stats
        self.eos_ids, self.decode_tail, self.grammars = eos_ids, decode_tail, grammars
        self.outputs: list[ReqOutput] = []

    def take(self, req: Req, result: ForwardResult, b: int) -> int:
        """Apply row `b` of the result to the request; returns the tokens it generated."""
        self._take_prompt_logprobs(req, result, b)
        if req.pooling is not None:
            return self._take_pooled(req, result, b)
        if req.drafts:
            return self._take_verified(req, result, b)
        if req.pending == 0:
            return self._take_token(req, result, b)
        return 0

    def _take_pooled(self, req: Req, result: ForwardResult, b: int) -> int:
        """Add this chunk's hidden states to the request's pool; once the whole prompt ran,
        its embedding is the mean (or the last), L2-normalized, or a classifier's logits, and
        the request ends."""
        got = result.pooled[b]
        summed = req.pooling == "mean" and req.pooled is not None
        req.pooled = req.pooled + got if summed else got
        if req.pending == 0:
            if req.pooling == "score":  # a classifier's logits, as they are
                req.embedding = req.pooled.tolist()
            else:
                mean = req.pooling == "mean"
                vector = req.pooled / len(req.input_ids) if mean else req.pooled
                req.embedding = torch.nn.functional.normalize(vector, dim=0).tolist()
            req.finish_reason = FinishReason("length", length=0)
        return 0

    def _take_prompt_logprobs(self, req: Req, result: ForwardResult, b: int) -> None:
        if not req.wants_prompt_logprobs:
            return
        if not req.input_logprobs and req.logprob_start_len == 0:
            req.input_logprobs.append([None, req.input_ids[0]])
            req.input_top_logprobs.append(None)
        got = result.prompt_logprobs[b]
        if got is not None:
            first = len(req.input_logprobs) + max(req.logprob_start_len, 0)
            targets = req.input_ids[first : first + len(got.logprobs)]
            req.input_logprobs += [[lp, t] for lp, t in zip(got.logprobs, targets)]
            tops = [_pairs(t) for t in got.top] if got.top else [None] * len(targets)
            req.input_top_logprobs += tops
        if len(req.kv_slots) >= len(req.input_ids):
            req.prompt_logprobs_done = True

    def _take_token(self, req: Req, result: ForwardResult, b: int) -> int:
        if req.params.max_new_tokens == 0:
            req.finish_reason = FinishReason("length", length=0)
            return 0
        self._append(req, result.next_token_ids[b], result.output_logprobs[b], 0)
        if req.grammar is not None and not req.finished and self.jump_forward:
            return 1 + self._jump_forward(req)
        return 1

    def append_token(self, req: Req, token: int) -> None:
        """Add an output token sampled elsewhere (a prefill server's first token)."""
        self._append(req, token, None, 0)

    def _append(self, req: Req, token: int, got: TokenLogprobs | None, i: int) -> None:
        """Add one output token (with the i-th logprob of `got`, when asked for) and set the
        finish reason it causes."""
        req.output_ids.append(token)
        if got is not None:
            req.output_logprobs.append([got.logprobs[i], token])
            req.output_top_logprobs.append(_pairs(got.top[i]) if got.top else None)
        if req.grammar is not None and not req.grammar.accept_token(token):
            req.finish_reason = FinishReason("abort", message=GRAMMAR_DEAD_END)
            return
        req.finish_reason = self._finish_reason(req, token)

    def _take_verified(self, req: Req, result: ForwardResult, b: int) -> int:
        """Append the accepted drafts and the sampled token, up to a finish; then free the KV
        slots of the drafts that were not kept, so that only accepted tokens reach the tree."""
        proposed, accepted = len(req.drafts), result.accepted_drafts[b]
        fed = len(req.fill_ids)  # the positions before the drafts
        taken = 0
        for i, token in enumerate(accepted + [result.next_token_ids[b]]):
            self._append(req, token, result.output_logprobs[b], i)
            taken += 1
            if req.finished:
                break
        keep = len(req.fill_ids) - 1  # the newest token's KV is computed next step
        self.kv.free_tail(req, keep)
        self.kv.keep_verified(req, fed, keep)
        req.synced = min(req.synced, keep)
        req.spec.draft_len = min(req.spec.draft_len, fed + len(accepted), keep)
        req.spec.record(proposed, len(accepted), len(req.output_ids))
        req.spec.drafts = []
        s = self.stats
        s.spec_verify_steps_total += 1
        s.spec_draft_tokens_total += proposed
        s.spec_accepted_tokens_total += len(accepted)
        return taken

    def _jump_forward(self, req: Req) -> int:
        """Append the tokens the grammar forces; the next step feeds them as one extend chunk.
        Skipped with logprobs, which only sampled tokens have."""
        if req.return_logprob:
            return 0
        room = req.params.max_new_tokens - len(req.output_ids)
        tokens, req.grammar = self.grammars.forced_tokens(req.grammar, room)
        req.output_ids += tokens
        self.stats.jump_forward_tokens_total += len(tokens)
        if tokens and len(req.output_ids) >= req.params.max_new_tokens:
            req.finish_reason = FinishReason("length", length=len(req.output_ids))
        return len(tokens)

    def _finish_reason(self, req: Req, token: int) -> FinishReason | None:
        p, out = req.params, req.output_ids
        if req.grammar is not None and req.grammar.is_terminated():
            return FinishReason("stop", matched=token)
        if len(out) >= p.min_new_tokens:
            if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
                return FinishReason("stop", matched=token)
            matched = self._matched_stop_string(req)
            if matched is not None:
                return FinishReason("stop", matched=matched)
        if len(out) >= p.max_new_tokens:
            return FinishReason("length", length=len(out))
        return None

    def _matched_stop_string(self, req: Req) -> str | None:
        """The stop string, or the text a stop regex matched, at the end of the output."""
        p = req.params
        if not (p.stop or p.stop_regex) or self.decode_tail is None:
            return None
        window = max([len(s) + 4 for s in p.stop] + [STOP_REGEX_WINDOW if p.stop_regex else 0])
        tail = self.decode_tail(req.output_ids[-window:])
        for stop in p.stop:
            if stop in tail:
                return stop
        for pattern in p.stop_regex:
            found = compile_stop_regex(pattern).search(tail)
            if found and found.group(0):
                return found.group(0)
        return None

    def emit(self, req: Req) -> None:
        """Queue the request's new tokens (and its end, once finished) for the detokenizer."""
        new = req.output_ids[req.sent_len :]
        if not new and not req.finished:
            return
        first = req.sent_len == 0
        req.sent_len = len(req.output_ids)
        out = ReqOutput(
            req.rid,
            new,
            req.finished,
            req.finish_reason,
            len(req.input_ids),
            len(req.output_ids),
            req.cached_tokens,
            queue_time=req.queue_time,
            stop=req.params.stop if first else None,
            skip_special_tokens=req.params.skip_special_tokens,
        )
        if req.finished:
            out.embedding = req.embedding
        if req.spec is not None:
            out.spec_verify_ct = req.spec.verify_steps
            out.spec_accepted_tokens = req.spec.accepted_total
        if req.return_logprob:
            out.output_logprobs = req.output_logprobs[req.sent_logprobs :]
            out.output_top_logprobs = req.output_top_logprobs[req.sent_logprobs :]
            req.sent_logprobs = len(req.output_logprobs)
            if req.finished or len(req.output_ids) == len(new):
                out.input_logprobs, out.input_top_logprobs = (
                    req.input_logprobs,
                    req.input_top_logprobs,
                )
        if req.finished:
            self.metrics.finished(req)
        self.outputs.append(out)

    def take_outputs(self) -> list[ReqOutput]:
        outputs, self.outputs = self.outputs, []
        return outputs


def _pairs(top: list[tuple[int, float]]) -> list[list]:
    return [[lp, tid] for tid, lp in top]
