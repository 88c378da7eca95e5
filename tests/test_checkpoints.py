"""Local HF checkpoints of the Llama family (Qwen2 with qkv bias, Llama-3 rope scaling) and dummy
shapes."""

import pytest
import torch

from radixserve import Engine


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def tiny_checkpoint(tmp_path, kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    else:
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
        model = LlamaForCausalLM(
            LlamaConfig(**common, tie_word_embeddings=False, rope_scaling=rope)
        )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.eval()
    model.save_pretrained(tmp_path / kind)
    return model, tmp_path / kind


@pytest.mark.parametrize("kind", ["qwen2", "llama3"])
def test_local_checkpoint_matches_hf(tmp_path, kind):
    model, path = tiny_checkpoint(tmp_path, kind)
    prompts = [[5, 17, 42, 99, 3], list(range(100, 180))]
    with Engine(
        model=str(path), max_total_tokens=1024, chunked_prefill_size=32, dtype="float32"
    ) as eng:
        results = eng.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
        )
        eng.check_memory()
    for ids, result in zip(prompts, results):
        assert result["output_ids"] == hf_greedy(model, ids, 12)


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
