import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture
def padded_llama():
    """``make(tokens, pad_from)``: a 2-layer float64 Llama in training mode and a batch of 2 rows
    of ``tokens``, the second right-padded from ``pad_from`` (labels -100 there): the shape the
    analysis modules read hooks from."""
    def make(tokens: int, pad_from: int):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2)).double().train()
        ids = torch.randint(0, 97, (2, tokens), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[1, pad_from:] = 0
        return model, {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return make
