"""The recurrent layers' sequence ops against HF transformers' torch references (Qwen3.5's
gated delta rule and causal convolution, Kimi Linear's per-channel rule), whole and split at
arbitrary points with the state carried across: a prompt resumed from a kept state must equal
the prompt run at once."""

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


def test_kimi_delta_attention_decays_each_key_channel_like_hf():
    """Kimi Linear's rule (a decay per key channel), chunked whole and split, then stepped,
    against HF's recurrent reference and its chunked form."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    q, k, v, _, beta = delta_inputs(150, 2, 2)
    g = -F.softplus(torch.randn(150, 2, 32, generator=torch.Generator().manual_seed(7)))
    batched = [x.unsqueeze(0) for x in (q, k, v, g, beta)]
    want, want_state = kimi.recurrent_kimi_delta_attention(
        *batched, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    chunked, _ = kimi.chunk_kimi_delta_attention(*batched, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(chunked[0], want[0], **TOL)
    parts, state = [], None
    for start, end in ((0, 37), (37, 101), (101, 149)):
        out, state = gated_delta_rule(*(x[start:end] for x in (q, k, v, g, beta)), state)
        parts.append(out)
    states = state.unsqueeze(0)
    parts.append(gated_delta_rule_step(*(x[149:] for x in (q, k, v, g, beta)), states))
    torch.testing.assert_close(torch.cat(parts), want[0], **TOL)
    torch.testing.assert_close(states[0], want_state[0], **TOL)


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


def scan_inputs(length: int, heads: int = 4, groups: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, heads, 8, generator=gen)
    dt = F.softplus(torch.randn(length, heads, generator=gen))
    b = torch.randn(length, groups, 16, generator=gen)
    c = torch.randn(length, groups, 16, generator=gen)
    return x, dt, b, c


def check_scan_whole_split_and_stepped(scan, step, hf_scan, inputs):
    """`scan(x, dt, b, c, state)` against `hf_scan(x, dt, b, c)` over 150 tokens at once and split
    across and inside chunks; `step(x, dt, b, c, states)` one token at a time in a batch
    continuing two prompts (`inputs(length, seed)` makes each)."""
    x, dt, b, c = inputs(150, 0)
    want, want_state = hf_scan(x, dt, b, c)
    got, state = scan(x, dt, b, c, None)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(state, want_state, **TOL)
    parts, state = [], None
    for start, end in ((0, 37), (37, 101), (101, 150)):
        out, state = scan(*(t[start:end] for t in (x, dt, b, c)), state)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts), want, **TOL)
    prompts = [inputs(n, n) for n in (5, 70)]
    states = torch.stack([scan(*p, None)[1] for p in prompts])
    for turn in range(3):
        token = [inputs(1, 1000 + 10 * turn + i) for i in range(2)]
        got = step(*(torch.cat([t[j] for t in token]) for j in range(4)), states)
        for i in range(2):
            prompts[i] = tuple(torch.cat([p, t]) for p, t in zip(prompts[i], token[i]))
            want, want_state = hf_scan(*prompts[i])
            torch.testing.assert_close(got[i], want[-1], **TOL)
            torch.testing.assert_close(states[i], want_state, **TOL)


def test_the_mamba2_scan_equals_hf_whole_split_and_stepped():
    """Nemotron-H's torch SSD scan as the reference."""
    from transformers.models.nemotron_h import modeling_nemotron_h as nemotron

    from radixserve.models.mamba2 import mamba2_scan, mamba2_step

    gen = torch.Generator().manual_seed(7)
    a, d = -torch.rand(4, generator=gen) * 2, torch.randn(4, generator=gen)

    def hf_scan(x, dt, b, c):
        out, state = nemotron.mamba2_chunk_scan(
            *(t.unsqueeze(0) for t in (x, dt)),
            a,
            *(t.unsqueeze(0) for t in (b, c)),
            chunk_size=16,
            D=d,
            return_final_states=True,
        )
        return out[0], state[0]

    check_scan_whole_split_and_stepped(
        lambda x, dt, b, c, s: mamba2_scan(x, dt, a, b, c, d, s),
        lambda x, dt, b, c, s: mamba2_step(x, dt, a, b, c, d, s),
        hf_scan,
        lambda length, seed: scan_inputs(length, seed=seed),
    )


def mamba1_inputs(length: int, seed: int, channels: int = 24):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, channels, generator=gen)
    dt = F.softplus(torch.randn(length, channels, generator=gen))
    return x, dt, torch.randn(length, 16, generator=gen), torch.randn(length, 16, generator=gen)


def test_the_mamba1_scan_equals_hf_whole_split_and_stepped():
    """Jamba's torch selective scan as the reference."""
    from transformers.models.jamba import modeling_jamba as jamba

    from radixserve.models.mamba1 import mamba1_scan, mamba1_step

    gen = torch.Generator().manual_seed(7)
    a, d = -torch.rand(24, 16, generator=gen) * 2, torch.randn(24, generator=gen)

    def hf_scan(x, dt, b, c):
        out, state = jamba.mamba_selective_scan(
            x.t()[None], dt.t()[None], a, b.t()[None], c.t()[None], D=d, return_last_state=True
        )
        return out[0].t(), state[0]

    check_scan_whole_split_and_stepped(
        lambda x, dt, b, c, s: mamba1_scan(x, dt, a, b, c, d, s),
        lambda x, dt, b, c, s: mamba1_step(x, dt, a, b, c, d, s),
        hf_scan,
        mamba1_inputs,
    )


def test_the_cpu_kernels_step_like_torch_in_place_on_the_rows():
    """The C++ decode steps (kernels/radixserve_kernels/cpu_recurrent.cpp) equal the torch
    steps, updating only the named rows of the states in place."""
    from radixserve.models.mamba2 import mamba2_step, mamba2_step_in_place
    from radixserve.models.recurrent import delta_step_in_place
    from radixserve_kernels.cpu_ops import load

    kernels = load()
    if kernels is None:
        pytest.skip("no C++ compiler: the torch steps run instead")
    gen = torch.Generator().manual_seed(3)
    rows = torch.tensor([4, 1, 6])
    states = torch.randn(8, 4, 32, 48, generator=gen)
    q, k, v, g, beta = delta_inputs(3, 2, 4, seed=9)
    want_states = states.clone()
    picked = want_states[rows]
    want = gated_delta_rule_step(q, k, v, g, beta, picked)
    want_states[rows] = picked
    got = delta_step_in_place(kernels, states, rows, q, k, v, g, beta)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(states, want_states, **TOL)

    ssm = torch.randn(8, 4, 8, 16, generator=gen)
    x, dt, b, c = scan_inputs(3, seed=5)
    a, d = -torch.rand(4, generator=gen), torch.randn(4, generator=gen)
    want_ssm = ssm.clone()
    picked = want_ssm[rows]
    want = mamba2_step(x, dt, a, b, c, d, picked)
    want_ssm[rows] = picked
    got = mamba2_step_in_place(kernels, ssm, rows, x, dt, a, b, c, d)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(ssm, want_ssm, **TOL)
