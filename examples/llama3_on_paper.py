import torch
import torch.nn as nn

CONFIGS = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
}

class CausalLM(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
    def forward(self, ids):
        return self.inner(input_ids=ids, labels=ids, use_cache=False).loss

def _llama(size, rows=1, seq=2048):
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, **CONFIGS[size])
    with torch.device("meta"):
        model = CausalLM(tf.LlamaForCausalLM(cfg))
    return model, (torch.zeros(rows, seq, dtype=torch.long, device="meta"),)

def llama3_8b():
    return _llama("8b")

def llama3_70b():
    return _llama("70b")
