"""Dummy shapes: random weights of a named shape, no checkpoint (the families against HF are
tests/test_model_families.py)."""

import pytest

from radixserve import Engine


def test_dummy_shapes_run():
    with Engine(model="dummy:tiny", max_total_tokens=256) as eng:
        r = eng.generate(
            input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4, "ignore_eos": True}
        )
    assert len(r["output_ids"]) == 4
    with pytest.raises(ValueError, match="unknown dummy shape"):
        Engine(model="dummy:nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        Engine(model="/nonexistent/model")
