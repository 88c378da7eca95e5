"""The process boundary: typed msgpack messages and the packed step inputs TP ranks receive."""

import msgspec
import pytest
import torch

from radixserve.ipc import decode, encode
from radixserve.messages import (
    BatchOut,
    ControlReply,
    FinishReason,
    ForwardBatch,
    ForwardMode,
    GenerateReq,
    ReqOutput,
)
from radixserve.sampling_params import SamplingParams
from radixserve.worker.step_inputs import StepInputs


def test_messages_round_trip_with_their_types():
    params = SamplingParams.from_dict(
        {"temperature": 0.5, "stop": "x", "logit_bias": {"5": 1.5}, "seed": 7}
    )
    req = GenerateReq("r", [1, 2, 3], params, return_logprob=True, top_logprobs_num=2)
    assert decode(encode(req)) == req
    out = BatchOut(
        [
            ReqOutput(
                "r",
                [4],
                True,
                FinishReason("stop", matched="x"),
                3,
                1,
                0,
                output_logprobs=[[-0.5, 4]],
                output_top_logprobs=[[[-0.5, 4]]],
            )
        ]
    )
    back = decode(encode(out))
    assert back == out and isinstance(back.outputs[0].finish_reason, FinishReason)
    reply = ControlReply("stats", "t", {"nested": [{"a": 1.5}]})
    assert decode(encode(reply)) == reply


def test_a_field_of_the_wrong_type_is_refused():
    raw = msgspec.msgpack.encode(("AbortReq", {"rid": 5}))
    with pytest.raises(msgspec.ValidationError, match="rid"):
        decode(raw)
    with pytest.raises(ValueError, match="unknown message type"):
        decode(msgspec.msgpack.encode(("Pickle", {})))


def test_finish_reason_json_is_sglangs():
    assert FinishReason("length", length=3).to_json() == {"type": "length", "length": 3}
    assert FinishReason("stop", matched=2).to_json() == {"type": "stop", "matched": 2}
    assert FinishReason("abort", message="aborted").to_json() == {
        "type": "abort",
        "message": "aborted",
    }


def test_step_inputs_pack_and_unpack_exactly():
    fb = ForwardBatch(
        ForwardMode.MIXED,
        input_ids=[5, 6, 7, 8],
        positions=[2, 3, 4, 9],
        out_cache_loc=[11, 12, 13, 20],
        rows=[0, 3],
        seq_lens=[5, 10],
        extend_lens=[3, 1],
        row_writes=[(0, 0, [1, 2]), (3, 4, [30])],
        sampling=None,
        logprobs=[None, None],
    )
    inputs = StepInputs.from_batch(fb, torch.device("cpu"))
    # the rows' new prefix slots, then this step's own slots
    assert inputs.table_rows.tolist() == [0, 0, 3, 0, 0, 0, 3]
    assert inputs.table_cols.tolist() == [0, 1, 4, 2, 3, 4, 9]
    assert inputs.table_slots.tolist() == [1, 2, 30, 11, 12, 13, 20]
    back = StepInputs.unpack(inputs.pack())
    assert back.mode == ForwardMode.MIXED and (back.max_seq_len, back.max_extend_len) == (10, 3)
    for name in (
        "input_ids",
        "positions",
        "out_cache_loc",
        "rows",
        "seq_lens",
        "extend_lens",
        "table_rows",
        "table_cols",
        "table_slots",
    ):
        assert torch.equal(getattr(back, name), getattr(inputs, name)), name
