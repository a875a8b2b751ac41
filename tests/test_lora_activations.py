"""What frozen weights and LoRA's adapters keep for backward (`adapters.kept_delta_bytes_per_token`): worked
by hand on a shipped profile, and the same answer as PEFT's own model traced on fake tensors."""
import pytest

from zerocalc import adapters, profile

LLAMA_1B = "llama-3.2-1b"      # h = 2048, f = 8192, kv = 8 heads × 64 = 512, 16 layers, RMSNorm
ALL = adapters.Lora(rank=16, targets="all-linear")
QKVO = adapters.Lora(rank=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"))


def _delta(lora, adapter_bytes, zero_init):
    p, mask = adapters.with_lora(profile.shipped_profile(LLAMA_1B), lora)
    return adapters.kept_delta_bytes_per_token(p, mask, 2, adapter_bytes, zero_init)


def test_lora_kept_bytes_by_hand():
    layers = 16
    # bf16 adapters (stages 0-2), all-linear r16, no dropout: lora_A keeps x, which the base kept anyway
    lora_a_out = 7 * 2 * 16                 # q k v o gate up down: lora_A's output, r bf16 elements each
    norms = 2 * 2 * 2048                    # input and post-attention RMSNorm: their frozen weight keeps no x
    assert _delta(ALL, 2, False) == layers * (lora_a_out - norms)
    # fp32 adapters under zero.Init (stage 3): each target keeps its own fp32 copy of its input
    copies = 4 * (2048 + 2048 + 2048 + 2048 + 2048 + 2048 + 8192)   # q k v o gate up (h), down (f)
    lora_a_out = 7 * 4 * 16
    # zero.Init's F.linear keeps every input, frozen or not: no input is freed
    assert _delta(ALL, 4, True) == layers * (copies + lora_a_out - norms)
    # attention only, bf16: the MLP's frozen linears keep nothing; o_proj's input is SDPA's kept output
    lora_a_out = 4 * 2 * 16
    gate_up_input, down_input = 2 * 2048, 2 * 8192
    assert _delta(QKVO, 2, False) == layers * (lora_a_out - gate_up_input - down_input - norms)
    # dropout: each target keeps the dropout's output and CUDA's bool mask instead of x
    drop = adapters.Lora(rank=16, targets="all-linear", dropout=0.05)
    kept_x = 2 * 2048 + 2 * 2048 + 2 * 8192   # q/k/v's, gate/up's and down's inputs: no longer kept
    assert _delta(drop, 2, False) == layers * ((2 + 1) * 20480 + 7 * 2 * 16 - kept_x - norms)


def test_moe_kept_bytes_by_hand():
    """Mixtral-8x7B (h = 4096, experts 14336 wide, top 2 of 8, 32 layers), LoRA on attention: the frozen
    experts' grouped matmuls keep neither the 2·T gathered rows nor their gated products, the frozen
    router not the block's input."""
    p, mask = adapters.with_lora(profile.shipped_profile("mixtral-8x7b"), QKVO)
    lora_a_out = 4 * 2 * 16                 # q k v o: lora_A's output, r bf16 elements each
    norms = 2 * 2 * 4096                    # input and post-attention RMSNorm
    experts = 2 * 2 * (4096 + 14336)        # top-2 rows a token: the up matmul's input (h), the down one's (f)
    router = 2 * 4096                       # the router's F.linear input
    assert adapters.kept_delta_bytes_per_token(p, mask, 2, 2, False) == 32 * (lora_a_out - norms - experts - router)
    # stage 3 under zero.Init: fp32 copies of q/k/v/o's inputs; zero.Init's F.linear keeps the router's
    # input, not grouped_mm's
    copies, lora_a_out = 4 * 4 * 4096, 4 * 4 * 16
    assert adapters.kept_delta_bytes_per_token(p, mask, 2, 4, True) == 32 * (copies + lora_a_out - norms - experts)


def test_full_fine_tune_keeps_what_it_kept():
    p = profile.shipped_profile(LLAMA_1B)
    assert adapters.kept_delta_bytes_per_token(p, (True,) * len(p.params), 2, 2, False) == 0


# ---------------------------------------------------------------- against PEFT's model on fake tensors

TINY = {
    "llama": {"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
    "qwen3": {"model_type": "qwen3", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    # MoE (fused experts run as grouped_mm over the k·T routed rows): experts 96 wide (Mixtral's
    # intermediate_size), 16 (Qwen2-MoE's moe_intermediate_size) beside a 24-wide shared expert
    "mixtral": {"model_type": "mixtral", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "qwen2_moe": {"model_type": "qwen2_moe", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
                  "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
                  "layer_types": ["full_attention"] * 2},
}
CASES = [("llama", dict(r=4, target_modules="all-linear"), False, False),
         ("llama", dict(r=4, target_modules="all-linear"), True, False),
         ("llama", dict(r=8, target_modules=["q_proj", "v_proj"]), False, False),
         ("llama", dict(r=8, target_modules=["q_proj", "v_proj"]), True, False),
         ("llama", dict(r=4, target_modules=["down_proj"], lora_dropout=0.1), False, False),
         ("llama", dict(r=4, target_modules="all-linear", lora_dropout=0.1), True, True),
         ("llama", dict(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), True, True),
         ("qwen3", dict(r=4, target_modules="all-linear"), False, False),
         ("qwen3", dict(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), True, True),
         ("mixtral", dict(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), False, False),
         ("mixtral", dict(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), True, True),
         ("qwen2_moe", dict(r=4, target_modules=["q_proj", "v_proj"]), False, False),
         ("qwen2_moe", dict(r=4, target_modules=r".*(self_attn\.[qkv]|shared_expert\.\w+)_proj"), False, False),
         ("qwen2_moe", dict(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), True, True)]


def _traced_layer_bytes_per_token(cfg, lora, fp32_adapters, zero_init):
    """What one decoder layer after the first keeps per token, PEFT's model on fake tensors
    (`memtrace.layer_activations` of a 2-layer less a 1-layer model)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from zerocalc.hf import memtrace, trace
    F = torch.nn.functional
    linear, dropout = F.linear, F.dropout
    if zero_init:
        zero = pytest.importorskip("deepspeed.runtime.zero.linear")
        F.linear = zero.zero3_linear_wrap      # what zero.Init leaves in place (`_enable_mem_efficient_linear`)
    # CUDA's fused dropout (a bool mask), where the CPU kernel keeps a mask of the input's dtype
    F.dropout = lambda x, p=0.5, training=True, inplace=False: torch.native_dropout(x, p, training)[0]
    try:
        out = []
        for layers in (1, 2):
            model, mode = trace.build(trace.hf_config(memtrace._shallow(cfg, layers)))
            if lora is not None:
                model = peft.get_peft_model(model, peft.LoraConfig(**lora))   # fp32 adapters (autocast_adapter_dtype)
                for name, p in model.named_parameters():
                    if ".lora_" in name and not fp32_adapters:
                        p.data = p.data.to(torch.bfloat16)        # the engine's cast at stages 0-2
            out.append(memtrace.layer_activations(model, mode)["bytes_per_token"])
    finally:
        F.linear, F.dropout = linear, dropout
    return out[1] - out[0]


@pytest.mark.parametrize("family, lora, fp32_adapters, zero_init", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_same_kept_bytes_as_peft(family, lora, fp32_adapters, zero_init):
    pytest.importorskip("torch")
    from zerocalc.hf import memtrace, trace
    cfg = TINY[family]
    traced = (_traced_layer_bytes_per_token(cfg, lora, fp32_adapters, zero_init)
              - _traced_layer_bytes_per_token(cfg, None, False, zero_init))
    one_layer = trace.trace(memtrace._shallow(cfg, 1), family, activations=False, steps=False)
    p, mask = adapters.with_lora(one_layer, adapters.from_peft_config({"peft_type": "LORA", **lora}))
    assert adapters.kept_delta_bytes_per_token(p, mask, 2, 4 if fp32_adapters else 2, zero_init) == traced
