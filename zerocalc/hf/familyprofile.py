"""The validator's families as profiles of any size: `python -m zerocalc.hf.familyprofile`.

Each family the validator trains (`zerocalc.hf.families`: the seed's GPT, Hugging Face GPT-2 and Llama;
tied or untied; Llama with and without its bias flags) is traced once (`zerocalc.hf.trace.record`) at
dimensions whose values, and their small multiples and halves, are all distinct (`TEMPLATE_DIMS`), so
every tensor dimension reads back as the one expression that gives it ("h", "3*h", "d/2") and the
layers' repeat as "L". `zerocalc/family_profiles.json` keeps them; `zerocalc.family` makes a profile of
any size from them without torch. The seed's GPT has no config.json to trace (`zerocalc.hf.ship`):
its profile at the seed's size is written here too (`zerocalc/profiles/seed-gpt.json`).
"""
import json
import os
import sys

from zerocalc import profile as P

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "family_profiles.json")
FORMAT = 1
LAYERS = 3
# V, h, f, kv = kv_heads·d, d, P: distinct, and so are 2x, 3x, 4x and x/2 of each (checked by `symbol`)
TEMPLATE_DIMS = {"vocab_size": 1009, "hidden_size": 200, "num_heads": 25, "num_kv_heads": 5, "ffn_hidden_size": 237,
                 "max_positions": 67, "num_layers": LAYERS}
# The seed's GPT as `../shared/seeds/zero3-param-sharding-case.txt` builds it: GPT-2's vocabulary, h 2048,
# 24 layers, 16 heads, FFN 4·h, untied.
SEED_GPT = {"vocab_size": 50257, "hidden_size": 2048, "num_layers": 24, "num_heads": 16, "num_kv_heads": 16,
            "ffn_hidden_size": 8192, "tie_embeddings": False}
VARIANTS = [("seed-gpt", tie, False, False) for tie in (False, True)] + \
    [("hf-gpt2", tie, False, False) for tie in (False, True)] + \
    [("hf-llama", tie, ab, mb) for tie in (False, True) for ab in (False, True) for mb in (False, True)]


def key(family: str, tie: bool, attention_bias: bool = False, mlp_bias: bool = False) -> str:
    return "/".join([family, "tied" if tie else "untied"] + ["attention_bias"] * attention_bias + ["mlp_bias"] * mlp_bias)


def _values(family: str, d: dict) -> dict:
    """The dimensions a family's tensors are sized by: V, h, f; GPT-2's position table P; Llama's
    key/value width kv (kv_heads·d) and head width d (its rotary tables hold d/2)."""
    v = {"V": d["vocab_size"], "h": d["hidden_size"], "f": d["ffn_hidden_size"]}
    if family == "hf-gpt2":
        v["P"] = d["max_positions"]
    if family == "hf-llama":
        head = d["hidden_size"] // d["num_heads"]
        v.update(kv=d["num_kv_heads"] * head, d=head)
    return v


def symbol(n: int, values: dict) -> str:
    """The one expression of the template's dimensions that equals n."""
    found = [e for x, v in values.items() for e, w in ((x, v), (f"2*{x}", 2 * v), (f"3*{x}", 3 * v), (f"4*{x}", 4 * v),
                                                         (f"{x}/2", v / 2)) if w == n]
    if len(found) != 1:
        raise ValueError(f"dimension {n} is {found or 'no expression'} of the template's {values}")
    return found[0]


def _symbolic(items, prefix: str, entry):
    """The compressed JSON entries (`profile._compress`) with `entry` applied to each and the layers'
    repeat as "L" (a repeat within a layer, the seed's three MLP calls, stays as it is)."""
    out = []
    for it in items:
        if isinstance(it, dict):
            if it["prefix"] == prefix and it["repeat"] != LAYERS:
                raise ValueError(f"the layers repeated {it['repeat']} times, traced with {LAYERS}")
            repeat = "L" if it["prefix"] == prefix else it["repeat"]
            out.append({**it, "repeat": repeat, "items": _symbolic(it["items"], prefix, entry)})
        else:
            out.append(entry(it))
    return out


def _hf_config(family: str, d: dict, attention_bias: bool, mlp_bias: bool) -> dict:
    """The config the validator builds the family from (`families._hf_config`)."""
    if family == "hf-gpt2":
        return {"model_type": "gpt2", "vocab_size": d["vocab_size"], "n_embd": d["hidden_size"], "n_layer": d["num_layers"],
                "n_head": d["num_heads"], "n_inner": d["ffn_hidden_size"], "n_positions": d["max_positions"],
                "tie_word_embeddings": d["tie_embeddings"], "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return {"model_type": "llama", "vocab_size": d["vocab_size"], "hidden_size": d["hidden_size"],
            "num_hidden_layers": d["num_layers"], "num_attention_heads": d["num_heads"],
            "num_key_value_heads": d["num_kv_heads"], "intermediate_size": d["ffn_hidden_size"],
            "max_position_embeddings": d["max_positions"], "tie_word_embeddings": d["tie_embeddings"],
            "attention_bias": attention_bias, "mlp_bias": mlp_bias}


def seed_gpt_profile(d: dict, name: str = "seed-gpt") -> P.Profile:
    """The seed's GPT (`families.SeedGPT`) read on fake tensors: its forward returns the logits (the
    validator trains it as it is), and its `checkpoint(block, x)` calls the block itself again."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from zerocalc.hf import families, trace
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = families.SeedGPT(d["vocab_size"], d["hidden_size"], d["num_layers"], d["num_heads"],
                                 d["ffn_hidden_size"], False, d["tie_embeddings"])
        ids = torch.zeros(2, trace.TRACE_TOKENS, dtype=torch.long)   # a batch of 2: nn.MultiheadAttention's usual path
        params, modules, root = trace.record(model, lambda: model(ids), lambda m: isinstance(m, families.SeedBlock),
                                             external=True)
    del mode
    dims = {k: d[k] for k in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                              "ffn_hidden_size", "tie_embeddings")}
    dims["head_dim"] = d["hidden_size"] // d["num_heads"]
    import transformers
    return P.Profile(name, "seed-gpt", dims, params, (), modules, root,
                     {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__,
                      "trace_version": trace.TRACE_VERSION}, returns_logits=True, checkpoint_reenters_layer=True)


def traced(family: str, d: dict, attention_bias: bool = False, mlp_bias: bool = False) -> P.Profile:
    """A family's profile at dimensions `d`: its parameters, buffers, modules and calls."""
    if family == "seed-gpt":
        return seed_gpt_profile(d, family)
    from zerocalc.hf import trace
    return trace.trace(_hf_config(family, d, attention_bias, mlp_bias), family, activations=False, steps=False)


def template(family: str, tie: bool, attention_bias: bool = False, mlp_bias: bool = False) -> dict:
    """The family's profile JSON at `TEMPLATE_DIMS`, sizes as expressions of the dimensions."""
    d = {**TEMPLATE_DIMS, "tie_embeddings": tie}
    if family == "seed-gpt":
        d["num_kv_heads"] = d["num_heads"]           # nn.MultiheadAttention: no grouped-query attention
    p = traced(family, d, attention_bias, mlp_bias)
    j = P.to_json(p)
    prefix = next(m.name for m in p.modules if m.layer)[:-1]     # "model.layers.", "transformer.h.", "blocks."
    values = _values(family, d)

    def sized(it):
        return [it[0], [symbol(n, values) for n in it[1]], *it[2:]]

    def call(node):
        name, grad, children = node
        return [name, grad, _symbolic(children, prefix, call)]
    return {"model_type": p.model_type, "params": _symbolic(j["params"], prefix, sized),
            "buffers": _symbolic(j["buffers"], prefix, sized), "modules": _symbolic(j["modules"], prefix, list),
            "calls": call(j["calls"]), "source": j["source"],
            **{k: j[k] for k in ("returns_logits", "checkpoint_reenters_layer") if k in j}}


def main() -> None:
    import transformers
    transformers.logging.set_verbosity_error()   # GPT-2's default token ids lie past the template's vocabulary
    out = {"format": FORMAT, "traced_at": TEMPLATE_DIMS, "families": {}}
    for family, tie, ab, mb in VARIANTS:
        out["families"][key(family, tie, ab, mb)] = template(family, tie, ab, mb)
        print(key(family, tie, ab, mb), flush=True)
    with open(OUT + ".tmp", "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    os.replace(OUT + ".tmp", OUT)
    P.save(seed_gpt_profile(SEED_GPT), os.path.join(P.SHIPPED_DIR, "seed-gpt.json"))


if __name__ == "__main__":
    sys.exit(main())
