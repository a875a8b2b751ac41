"""LoRA and frozen parameters: zerocalc's torch-free adapters (`zerocalc.adapters`, from a profile's
modules) against PEFT 0.21 itself on the same model, and the model-state and communication terms
they change, worked out by hand."""
import json
import os

import pytest

from zerocalc import adapters, comm, states
from zerocalc.model import ModelSpec
from zerocalc.training import Setup, Stage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- by hand

def _tiny(trainable):
    """Four tensors of 10, 6, 4 and 20 elements, one module each."""
    numels = (10, 6, 4, 20)
    return ModelSpec("tiny", numels, ((),) + tuple((i,) for i in range(4)), trainable=trainable)


def test_states_with_frozen_tensors_by_hand():
    m = _tiny((False, True, True, False))    # P = 40, P_t = 6 + 4 = 10, P_f = 30
    # stage 0 bf16: params 2·40; fp32 master 4·10; Adam 8·10; largest grads 2·10
    st = states.model_states(m, Setup(stage=Stage.DISABLED, dp=2))
    assert (st.params_bytes, st.master_bytes, st.moments_bytes, st.largest_grads_bytes) == (80, 40, 80, 20)
    # stage 2, N = 2: trained flat group padded to a multiple of 2N = 4: Pp = 12, S = 6
    # params 2·12 + frozen whole 2·30 = 84; master 4·6; Adam 8·6; G_in: rank 0's slice [0, 6) holds the
    # 6-element tensor whole, rank 1's [6, 12) the 4-element one: 6; largest grads 2·6
    st = states.model_states(m, Setup(stage=Stage.GRADIENTS, dp=2))
    assert (st.params_bytes, st.master_bytes, st.moments_bytes, st.largest_grads_bytes) == (84, 24, 48, 12)
    # stage 3, N = 2, nothing persistent: S3 = 5 + 3 + 2 + 10 = 20 over all; S3_t = 3 + 2 = 5
    # params 2·20; master 4·5; Adam 8·5; grad partitions 2·5; ipg bucket 2·RBS = 2·100
    st = states.model_states(m, Setup(stage=Stage.PARAMETERS, dp=2, param_persistence_threshold=0,
                                      reduce_bucket_size=100))
    assert (st.params_bytes, st.master_bytes, st.moments_bytes, st.grads_bytes, st.buffers_bytes) == \
        (40, 20, 40, 10, 200)


def test_comm_with_frozen_tensors_by_hand():
    m = _tiny((False, True, True, False))
    by = lambda colls: {(c.op, c.phase): c.bytes for c in colls}   # noqa: E731
    # stage 0: all-reduce of the trained gradients, 2·10
    assert by(comm.collectives(m, Setup(stage=Stage.DISABLED, dp=2)))[("all_reduce", "backward")] == 20
    # stage 2: all-reduce 2·10; all-gather of the trained flat shard S = 6: 2·6
    c = by(comm.collectives(m, Setup(stage=Stage.GRADIENTS, dp=2)))
    assert c[("all_reduce", "backward")] == 20 and c[("all_gather_into_tensor", "step")] == 12
    # stage 3: forward all-gather of every shard (S3 = 20): 2·20; reduce-scatter of N·S3_t = 2·5: 2·10
    c = by(comm.collectives(m, Setup(stage=Stage.PARAMETERS, dp=2, param_persistence_threshold=0)))
    assert c[("all_gather_into_tensor", "forward")] == 40 and c[("reduce_scatter_tensor", "backward")] == 20


def test_every_tensor_trained_is_the_full_model():
    full, marked = _tiny(None), _tiny((True,) * 4)
    for stage in Stage:
        s = Setup(stage=stage, dp=2)
        assert states.model_states(full, s) == states.model_states(marked, s)
        assert comm.collectives(full, s) == comm.collectives(marked, s)


# ---------------------------------------------------------------- shipped profiles, without torch

def test_lora_on_a_shipped_profile_by_hand():
    from zerocalc import profile
    p = profile.shipped_profile("llama-3.2-1b")
    s = adapters.spec(p, adapters.Lora(rank=16), name="llama-3.2-1b")
    # Llama-3.2-1B: h 2048, kv 512 (8 heads of 64), ffn 8192, 16 layers. Per layer, A r·in + B out·r:
    # q (2048+2048)·16, k (2048+512)·16, v (2048+512)·16, o (2048+2048)·16,
    # gate (2048+8192)·16, up (2048+8192)·16, down (8192+2048)·16; the tied head is left out
    per_layer = 16 * (4096 + 2560 + 2560 + 4096 + 10240 * 3)
    assert s.num_trainable == 16 * per_layer == 11_272_192
    assert s.num_params == p.num_params + s.num_trainable
    assert len(s.param_numels) == len(p.params) + 2 * 7 * 16


def test_attention_only_targets_and_dora():
    from zerocalc import profile
    p = profile.shipped_profile("qwen2.5-0.5b")    # h 896, kv 128 (2 heads of 64), 24 layers
    s = adapters.spec(p, adapters.Lora(rank=8, targets=("q_proj", "v_proj"), dora=True))
    # q: A 8·896 + B 896·8 + magnitude 896; v: A 8·896 + B 128·8 + magnitude 128
    assert s.num_trainable == 24 * ((8 * 896 + 896 * 8 + 896) + (8 * 896 + 128 * 8 + 128))


@pytest.mark.parametrize("lora, message", [
    (adapters.Lora(rank=0), "rank must be a positive"),
    (adapters.Lora(rank=8, targets=("qkv",)), "match no module"),
    (adapters.Lora(rank=8, targets=("embed_tokens",)), "is a Embedding"),
])
def test_bad_lora_is_refused(lora, message):
    from zerocalc import profile
    with pytest.raises(ValueError, match=message):
        adapters.spec(profile.shipped_profile("llama-3.2-1b"), lora)


def test_all_linear_on_experts_is_refused_by_name():
    """PEFT 0.21 wraps Mixtral's fused experts and router too (ParamWrapper): not modelled, said so."""
    from zerocalc import profile
    with pytest.raises(ValueError, match="MixtralSparseMoeBlock: ParamWrapper"):
        adapters.spec(profile.shipped_profile("mixtral-8x7b"), adapters.Lora(rank=8))
    with pytest.raises(ValueError, match="is a MixtralTopKRouter"):
        adapters.spec(profile.shipped_profile("mixtral-8x7b"), adapters.Lora(rank=8, targets=("gate",)))


def test_freeze_by_module_names():
    from zerocalc import profile
    p = profile.shipped_profile("llama-3.2-1b")
    s = adapters.spec(p, freeze=("embed_tokens", "layers.{0..3}"))
    layer = sum(p.params[i].numel for m in p.modules if m.name.startswith("model.layers.0.") for i in m.params)
    # the tied embedding/head 128256·2048 and four layers
    assert s.num_frozen == 128256 * 2048 + 4 * layer
    with pytest.raises(ValueError, match="matches no module"):
        adapters.spec(p, freeze=("vision_tower",))


def test_lora_wrapper_fetches_lora_a_and_the_peft_wrappers_are_calls():
    """A wrapped Linear becomes lora.Linear > base_layer, lora_dropout, lora_A, lora_B; stage 3 fetches
    lora_A's weight at the wrapper's hook as well as at lora_A's (PEFT reads its dtype first). PEFT's
    task_type decides the calls around the model: PeftModelForCausalLM > LoraModel (two), or a bare
    PeftModel (one) without a task_type, as the validator's jobs build it."""
    from zerocalc import profile
    p = profile.shipped_profile("qwen2.5-0.5b")
    lora = adapters.Lora(rank=4, targets=("q_proj",))
    causal = adapters.spec(p, lora, wrapper=False)
    bare = adapters.spec(p, adapters.Lora(rank=4, targets=("q_proj",), task_type=None), wrapper=False)
    assert causal.trace[:2] == ((), ()) and causal.trace[1:] == bare.trace
    # q_proj: lora.Linear (holding lora_A), base_layer (weight, bias), lora_dropout, lora_A, lora_B
    q = next(i for i, t in enumerate(bare.trace) if len(t) == 2)   # the first call with two tensors: q's base layer
    wrapper, base, dropout, a, b = bare.trace[q - 1:q + 4]
    assert wrapper == a and len(a) == 1 and dropout == () and len(b) == 1
    # r·in = 4·896 for lora_A, out·r = 896·4 for lora_B, and 896·896 + 896 for the frozen base
    assert (bare.param_numels[a[0]], bare.param_numels[b[0]]) == (4 * 896, 896 * 4)
    assert sorted(bare.param_numels[i] for i in base) == [896, 896 * 896]


def test_peft_config_file():
    d = {"peft_type": "LORA", "r": 32, "lora_alpha": 64, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"],
         "use_rslora": True, "bias": "none", "modules_to_save": None}
    lora = adapters.from_peft_config(d)
    assert (lora.rank, lora.targets, lora.rslora, lora.scaling) == (32, ("q_proj", "v_proj"), True, 64 / 32 ** 0.5)
    assert lora.task_type is None and adapters.from_peft_config({**d, "task_type": "CAUSAL_LM"}).task_type == "CAUSAL_LM"
    with pytest.raises(ValueError, match="peft_type 'IA3'"):
        adapters.from_peft_config({**d, "peft_type": "IA3"})
    with pytest.raises(ValueError, match="modules_to_save"):
        adapters.from_peft_config({**d, "modules_to_save": ["lm_head"]})


# ---------------------------------------------------------------- the same tensors as PEFT builds

TINY = {
    "llama": {"model_type": "llama", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "gpt2": {"model_type": "gpt2", "vocab_size": 97, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
    "mixtral": {"model_type": "mixtral", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "qwen2_moe": {"model_type": "qwen2_moe", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48,
                  "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2},
}
CASES = [("llama", dict(r=4, target_modules="all-linear", lora_dropout=0.1)),
         ("llama", dict(r=3, target_modules=["q_proj", "v_proj"], use_dora=True)),
         ("llama", dict(r=2, target_modules=r".*\.mlp\..*_proj", bias="all")),
         ("gpt2", dict(r=4, target_modules="all-linear")),
         ("mixtral", dict(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
         ("qwen2_moe", dict(r=4, target_modules=r".*(self_attn\.[qkv]|shared_expert\.\w+)_proj"))]


def _peft_model(cfg: dict, lora: dict):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from validate import hf_models
    model = hf_models.build(cfg, "bf16")
    model = peft.get_peft_model(model, peft.LoraConfig(**lora))
    order = []
    own = {}
    for name, m in model.named_modules():
        ps = list(m.parameters(recurse=False))
        if isinstance(m, peft.tuners.lora.LoraLayer) and not ps:
            # lora.Linear reads lora_A's weight in its own forward: at stage 3 it fetches it (`adapters.with_lora`)
            ps = [m.lora_A["default"].weight]
        if ps:
            own[id(m)] = ps
            m.register_forward_pre_hook(lambda mod, args, name=name: order.append(id(mod)))
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    model(input_ids=torch.randint(0, cfg["vocab_size"], (1, 5)))
    trace = [tuple(index[id(p)] for p in own[m]) for m in order]
    return [p.numel() for p in params], [p.requires_grad for p in params], trace


@pytest.mark.parametrize("family, lora", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_same_tensors_and_calls_as_peft(family, lora):
    """PEFT's model and zerocalc's adapted profile (traced from the same config.json, torch-free from
    there): the same parameter tensors in `parameters()` order, the same ones trainable, and the
    modules with parameters called in the same forward order (stage 3's fetch trace)."""
    pytest.importorskip("torch")
    from zerocalc.hf import trace
    cfg = TINY[family]
    numels, trainable, order = _peft_model(cfg, lora)
    d = {"peft_type": "LORA", **lora}
    ours = adapters.spec(trace.trace(cfg, family, activations=False, steps=False),
                         adapters.from_peft_config(d), wrapper=False, z3_leaf_moe=False)
    assert list(ours.param_numels) == numels
    assert list(ours.trainable) == trainable
    assert [t for t in ours.trace if t] == order


def test_shipped_profile_and_trace_agree():
    """A shipped profile adapted without torch and the same config traced now: the same model."""
    pytest.importorskip("torch")
    from zerocalc import profile
    from zerocalc.hf import ship, trace
    with open(ship.configs()["qwen2.5-0.5b"]) as f:
        cfg = json.load(f)
    lora = adapters.Lora(rank=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    shipped = adapters.spec(profile.shipped_profile("qwen2.5-0.5b"), lora)
    traced = adapters.spec(trace.trace(cfg, "qwen2.5-0.5b", activations=False, steps=False), lora)
    assert (shipped.param_numels, shipped.trainable, shipped.trace) == (traced.param_numels, traced.trainable,
                                                                       traced.trace)


# ---------------------------------------------------------------- the command line

def test_cli_lora_and_freeze():
    from click.testing import CliRunner
    from zerocalc.cli import main
    run = lambda *a: CliRunner().invoke(main, list(a))   # noqa: E731
    r = run("estimate", "--model", "llama-3.2-1b", "--lora-rank", "16", "--stage", "2", "--format", "json")
    assert r.exit_code == 0, r.output
    inputs = json.loads(r.stdout)["inputs"]
    assert (inputs["trainable_params"], inputs["frozen_params"]) == (11_272_192, 1_235_814_400)
    r = run("estimate", "--model", "llama-3.2-1b", "--freeze", "embed_tokens", "--stage", "2", "--format", "csv")
    assert r.exit_code == 0 and r.stdout.splitlines()[0].endswith("trainable_params,frozen_params")
    for args, message in ((("--lora-rank", "0"), "rank must be a positive"),
                          (("--lora-rank", "8", "--lora-targets", "qkv"), "its linear modules: model.layers.{i}"),
                          (("--freeze", "vision_tower"), "matches no module"),
                          (("--lora-rank", "8", "--freeze", "embed_tokens"), "PEFT already freezes")):
        r = run("estimate", "--model", "llama-3.2-1b", *args)
        assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output, r.output
    r = run("estimate", "--params", "7e9", "--lora-rank", "8")
    assert r.exit_code == 2 and "need the model's modules" in r.output


def test_cli_peft_config_and_plan(tmp_path):
    from click.testing import CliRunner
    from zerocalc.cli import main
    cfg = tmp_path / "adapter_config.json"
    cfg.write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                               "use_dora": True}))
    r = CliRunner().invoke(main, ["estimate", "--model", "qwen2.5-0.5b", "--peft-config", str(cfg)])
    assert r.exit_code == 2 and "DoRA at ZeRO stage 3" in r.output
    r = CliRunner().invoke(main, ["estimate", "--model", "qwen2.5-0.5b", "--peft-config", str(cfg), "--stage", "0,1,2"])
    assert r.exit_code == 0 and "DoRA r8 q_proj,v_proj" in r.output, r.output
    cfg.write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    r = CliRunner().invoke(main, ["estimate", "--model", "qwen2.5-0.5b", "--peft-config", str(cfg)])
    assert r.exit_code == 2 and "not other PEFT methods" in r.output
    r = CliRunner().invoke(main, ["plan", "--model", "llama-3-8b", "--lora-rank", "16", "--gpu", "a100-40g",
                                  "--seq-len", "2048", "--global-batch", "16", "--max-gpus", "2"])
    assert r.exit_code == 0 and "trainable" in r.output, r.output


def test_cli_lora_estimate_simulates_its_own_stream():
    """With the trace extra and PEFT, estimate records the LoRA model's stream (`zerocalc.hf.adapted`) and
    answers reserved from the allocator simulation, as for a full fine-tune; the note says so."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from click.testing import CliRunner
    from zerocalc.cli import main
    r = CliRunner().invoke(main, ["estimate", "--model", "llama-3.2-1b", "--lora-rank", "16", "--stage", "2",
                                  "--seq-len", "512", "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)["estimates"][0]
    assert out["peak_reserved_source"] == "simulated" and out["peak_reserved_bytes"] >= out["peak_bytes"]
    assert "reserved: its traced allocation stream through the allocator simulation" in r.stderr


def test_cli_sweep_takes_a_model_with_lora():
    """sweep --model with the --lora flags: each point the LoRA model's states and traffic. Llama-3.2-1B
    with r 16 on all seven linears of its 16 layers: A (16 × in) and B (out × 16) per linear, q and o
    16·(2048 + 2048), k and v 16·(2048 + 512), gate, up and down 16·(2048 + 8192): 704,512 a layer,
    P_t = 11,272,192 of P = 1,247,086,592."""
    from click.testing import CliRunner
    from zerocalc.cli import main
    r = CliRunner().invoke(main, ["sweep", "--model", "llama-3.2-1b", "--lora-rank", "16", "--dp", "8", "--stage", "2"])
    assert r.exit_code == 0, r.output
    header, row = (line.split(",") for line in r.stdout.splitlines())
    got = dict(zip(header, row))
    p, p_t = 1_247_086_592, 11_272_192
    assert (int(got["num_params"]), int(got["trainable_params"])) == (p, p_t)
    s = p_t // 8                       # the trained flat group (a multiple of 2N = 16 already), per rank
    # stage 2: the flat bf16 group of the trained tensors, the frozen ones whole, fp32 master and Adam's two
    # moments of S, and the rotary embedding's inv_freq and original_inv_freq (head_dim / 2 = 32 fp32 each)
    assert int(got["resident_bytes"]) == 2 * p_t + 2 * (p - p_t) + (4 + 8) * s + 2 * 32 * 4
    # the trained gradients reduced (bf16), the updated slices all-gathered, the 4-byte norm and overflow flag
    assert int(got["comm_bytes"]) == 2 * p_t + 2 * s + 4 + 1
    bad = CliRunner().invoke(main, ["sweep", "--params", "7e9", "--lora-rank", "16"])
    assert bad.exit_code == 2 and "need the model's modules" in bad.output
    bad = CliRunner().invoke(main, ["sweep", "--params", "7e9", "--model", "llama-3.2-1b"])
    assert bad.exit_code == 2 and "give --params" in bad.output
