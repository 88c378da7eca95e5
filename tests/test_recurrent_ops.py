"""The recurrent layers' sequence ops against HF transformers' torch references (Qwen3.5's
gated delta rule and causal convolution), whole and split at arbitrary points with the state
carried across: a prompt resumed from a kept state must equal the prompt run at once."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from radixserve.models.recurrent import (
    causal_conv1d,
    causal_conv1d_step,
    gated_delta_rule,
    gated_delta_rule_step,
)

TOL = dict(rtol=1e-4, atol=1e-4)


def delta_inputs(length: int, key_heads: int, value_heads: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, key_heads, 32, generator=gen)
    k = torch.randn(length, key_heads, 32, generator=gen)
    v = torch.randn(length, value_heads, 48, generator=gen)
    g = -F.softplus(torch.randn(length, value_heads, generator=gen))  # log decay <= 0
    beta = torch.rand(length, value_heads, generator=gen)
    return q, k, v, g, beta


def hf_delta(q, k, v, g, beta, state=None):
    out, final = hf.torch_recurrent_gated_delta_rule(
        *(x.unsqueeze(0) for x in (q, k, v, g, beta)),
        initial_state=None if state is None else state.unsqueeze(0),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], final[0]


@pytest.mark.parametrize("key_heads,value_heads", [(2, 2), (2, 4)])
def test_the_chunked_gated_delta_rule_equals_hf_whole_and_split(key_heads, value_heads):
    q, k, v, g, beta = delta_inputs(150, key_heads, value_heads)
    want, want_state = hf_delta(q, k, v, g, beta)
    got, state = gated_delta_rule(q, k, v, g, beta, None)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(state, want_state, **TOL)
    # split across a chunk boundary and inside a chunk: the state carries the prefix
    parts, state = [], None
    for start, end in ((0, 37), (37, 101), (101, 150)):
        out, state = gated_delta_rule(*(x[start:end] for x in (q, k, v, g, beta)), state)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts), want, **TOL)
    torch.testing.assert_close(state, want_state, **TOL)
    hf_chunked, _ = hf.torch_chunk_gated_delta_rule(
        *(x.unsqueeze(0) for x in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(got, hf_chunked[0], **TOL)


def test_decode_steps_continue_a_prompt_like_hf():
    """Three sequences of different prompts, each resumed by one-token steps in a batch."""
    prompts = [delta_inputs(n, 2, 4, seed=n) for n in (5, 70, 129)]
    states = torch.stack([gated_delta_rule(*p, None)[1] for p in prompts])
    for step in range(3):
        token = [delta_inputs(1, 2, 4, seed=1000 + 10 * step + i) for i in range(3)]
        batched = [torch.cat([t[j] for t in token]) for j in range(5)]
        got = gated_delta_rule_step(*batched, states)
        for i, p in enumerate(prompts):
            prompts[i] = tuple(torch.cat([a, b]) for a, b in zip(p, token[i]))
            want, want_state = hf_delta(*prompts[i])
            torch.testing.assert_close(got[i], want[-1], **TOL)
            torch.testing.assert_close(states[i], want_state, **TOL)


def test_the_causal_convolution_resumes_from_its_state():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 24, generator=gen)
    weight, bias = torch.randn(24, 4, generator=gen), torch.randn(24, generator=gen)
    want = hf.causal_conv1d_fn(x.t().unsqueeze(0), weight, bias)[0].t()
    whole, _ = causal_conv1d(x, weight, bias, None)
    torch.testing.assert_close(whole, want, **TOL)
    first, state = causal_conv1d(x[:17], weight, bias, None)
    rest, state = causal_conv1d(x[17:38], weight, bias, state)
    states = state.unsqueeze(0).clone()
    steps = [causal_conv1d_step(x[t : t + 1], weight, bias, states) for t in (38, 39)]
    torch.testing.assert_close(torch.cat([first, rest, *steps]), want, **TOL)
    torch.testing.assert_close(states[0], x[37:40].t(), **TOL)
