"""The transcribed families as torch modules: the case study's GPT and Hugging Face GPT-2 / Llama built
from an Architecture with random weights. The validator trains them (`validate.worker`), and the
families' allocation streams and operator counts are traced from them (`zerocalc.hf.familystream`,
`zerocalc.hf.optrace`), so they live beside the tracer (the `trace` extra), below the validator.
They are traced into the families' profiles (`zerocalc.hf.familyprofile`); their parameter order and
shapes equal arch.py's hand enumeration (`zerocalc.arch.param_numels`, tests/test_validate_models.py)."""
import torch
import torch.nn as nn


class SeedBlock(nn.Module):
    """One block of the case study's model, as the seed wrote it (ln1 applied three times)."""

    def __init__(self, hidden, heads, ffn):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))

    def forward(self, x):
        x = x + self.attn(self.ln1(x), self.ln1(x), self.ln1(x))[0]
        return x + self.mlp(self.ln2(x))


class SeedGPT(nn.Module):
    """`../shared/seeds/zero3-param-sharding-case.txt`: embedding, blocks, final LayerNorm, untied head
    without bias, no position embedding."""

    def __init__(self, vocab, hidden, layers, heads, ffn, checkpointing=False, tie=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList([SeedBlock(hidden, heads, ffn) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.checkpointing = checkpointing

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            if self.checkpointing:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM returning logits only, so every family trains the same way."""

    def __init__(self, hf_model):
        super().__init__()
        self.model = hf_model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def _hf_config(arch, attention):
    import transformers
    attn = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}[attention]
    if arch["family"] == "hf-gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=arch["vocab_size"], n_embd=arch["hidden_size"], n_layer=arch["num_layers"],
            n_head=arch["num_heads"], n_inner=arch["ffn_hidden_size"], n_positions=arch["max_positions"],
            tie_word_embeddings=arch["tie_embeddings"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel, cfg, attn
    cfg = transformers.LlamaConfig(
        vocab_size=arch["vocab_size"], hidden_size=arch["hidden_size"], num_hidden_layers=arch["num_layers"],
        num_attention_heads=arch["num_heads"], num_key_value_heads=arch["num_kv_heads"],
        intermediate_size=arch["ffn_hidden_size"], max_position_embeddings=arch["max_positions"],
        tie_word_embeddings=arch["tie_embeddings"], attention_bias=arch.get("attention_bias", False),
        mlp_bias=arch.get("mlp_bias", False))
    return transformers.LlamaForCausalLM, cfg, attn


def build_model(arch, checkpointing=False, attention="sdpa", zero_weights_dtype=None):
    """An fp32 module on the CPU with random weights; `arch` is zerocalc's Architecture as a dict.
    zero_weights_dtype ("bf16", "fp16", "fp32"): every parameter zero and in that dtype instead, made
    without the initialisers (a 13B model's random init in fp32 takes minutes of CPU and 52 GB):
    DeepSpeed casts the parameters to the training dtype on the host anyway, and the buffers are
    made as before (HF Llama's rotary tables in fp32 whatever the default dtype), so the device sees
    the same tensors; the loss never overflows fp16. For jobs that measure memory only (the
    fake-world rows, `validate.worker`)."""
    if zero_weights_dtype:
        from transformers.initialization import no_init_weights
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[zero_weights_dtype]
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with no_init_weights():
                model = build_model(arch, checkpointing, attention)
        finally:
            torch.set_default_dtype(default)
        if isinstance(model, HFCausalLM):
            model.model.tie_weights()      # no_init_weights skips init_weights, which ties them
        with torch.no_grad():
            for p in model.parameters():   # under zero.Init a parameter's data is its partition
                getattr(p, "ds_tensor", p).zero_()
        return model
    if arch["family"] == "seed-gpt":
        return SeedGPT(arch["vocab_size"], arch["hidden_size"], arch["num_layers"], arch["num_heads"],
                       arch["ffn_hidden_size"], checkpointing, arch["tie_embeddings"])
    cls, cfg, attn = _hf_config(arch, attention)
    model = cls._from_config(cfg, attn_implementation=attn)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return HFCausalLM(model)
