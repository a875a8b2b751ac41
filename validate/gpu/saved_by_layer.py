"""What autograd keeps for backward in each decoder layer of one forward of an HF model, on the device
it runs on: every tensor saved for backward (`torch.autograd.graph.saved_tensors_hooks`, custom
kernels' `save_for_backward` included) but the weights, counted once per storage, grouped by the layer
whose forward saved it. Run on a CPU and on a GPU with the same config, the two lists show whether an
operator keeps more on one device than on the other (the traced stream is the CPU's); the forward
alone is run (a CPU's backward of a large vocabulary takes minutes). Printed as JSON:

    python validate/gpu/saved_by_layer.py CONFIG.json --layers 4 --batch 2 --seq-len 2048 --device cuda

CONFIG.json: a config.json or a validate matrix with one "hf_models" entry (its config is used). Also
says which fast kernels are installed (flash-linear-attention, causal-conv1d, flash-attn). Evidence it
gave: data/README.md, "Why the Qwen3-Next trace missed"."""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def config_of(path: str, layers: int | None, layer_type: str | None) -> dict:
    """The config a config.json or a matrix's first "hf_models" entry (its overrides applied) describes,
    as `validate run` reads it (`hf_models.load_config`), cut to `layers` and made all `layer_type`."""
    from validate import hf_models
    with open(path) as f:
        matrix = json.load(f)
    entry = matrix["hf_models"][0] if "hf_models" in matrix else {"config": path}
    _, cfg = hf_models.load_config(entry["config"], entry.get("overrides"))
    if layers:
        cfg["num_hidden_layers"] = layers
        if isinstance(cfg.get("layer_types"), list):
            cfg["layer_types"] = (cfg["layer_types"] * layers)[:layers]
    if layer_type:
        cfg["layer_types"] = [layer_type] * cfg["num_hidden_layers"]
    return cfg


def fast_kernels() -> dict:
    out = {}
    for name in ("fla", "causal_conv1d", "flash_attn"):
        try:
            __import__(name)
            out[name] = True
        except Exception as err:   # noqa: BLE001  (absent or broken: either way not used)
            out[name] = f"{type(err).__name__}"
    return out


def saved_by_layer(model, ids) -> list[dict]:
    layers = model.get_decoder().layers
    current = [None]
    # the weights are saved too, but are not activations
    seen = {(p.untyped_storage().data_ptr(), p.device.type): None for p in model.parameters()}
    per_layer = [dict(index=i, kind=getattr(model.config, "layer_types", [None] * len(layers))[i], tensors=[])
                 for i in range(len(layers))]

    def pack(t):
        i = current[0]
        if i is not None and t.device.type != "meta":
            key = (t.untyped_storage().data_ptr(), t.device.type)
            if key not in seen:
                seen[key] = i
                per_layer[i]["tensors"].append([list(t.shape), str(t.dtype).replace("torch.", ""),
                                                t.untyped_storage().nbytes()])
        return t

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    for p in per_layer:
        p["bytes"] = sum(t[2] for t in p["tensors"])
        p["tensors"].sort(key=lambda t: -t[2])
    return per_layer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--layer-type", help="every layer this kind (layer_types)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    from validate import hf_models
    cfg = config_of(args.config, args.layers, args.layer_type)
    torch.manual_seed(0)
    model = hf_models.build(cfg, "bf16").to(args.device)
    ids = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq_len), device=args.device)
    layers = saved_by_layer(model, ids)
    tokens = args.batch * args.seq_len
    print(json.dumps({"device": args.device, "tokens": tokens, "fast_kernels": fast_kernels(),
                      "layers": [dict(p, bytes_per_token=p["bytes"] / tokens, tensors=p["tensors"][:12])
                                 for p in layers]}))


if __name__ == "__main__":
    main()
