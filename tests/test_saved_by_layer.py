"""validate/gpu/saved_by_layer.py counts what autograd keeps for backward, layer by layer, by storage,
the weights left out (the probe that found why the Qwen3-Next trace misses: data/README.md)."""
import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def probe():
    path = os.path.join(ROOT, "validate", "gpu", "saved_by_layer.py")
    spec = importlib.util.spec_from_file_location("saved_by_layer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Toy(torch.nn.Module):
    """An embedding of width 8 and two layers, Linear(8 -> 16) + ReLU and Linear(16 -> 16) + ReLU, fp32."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.ReLU()),
                                           torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False), torch.nn.ReLU())])
        self.config = type("Config", (), {})()

    def get_decoder(self):
        return self

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_each_layer_counts_the_activations_it_saved_once_and_no_weight():
    """4 tokens. Layer 0's Linear saves its input, the embedding's output (4 x 8 x 4 B = 128 B), and its
    weight (left out); its ReLU saves its output (4 x 16 x 4 B = 256 B): 384 B. Layer 1's Linear saves
    its input, layer 0's output, already counted there, and its ReLU its own output: 256 B."""
    layers = probe().saved_by_layer(Toy(), torch.zeros(1, 4, dtype=torch.long))
    assert [p["bytes"] for p in layers] == [128 + 256, 256]
    assert sorted(tuple(t[0]) for t in layers[0]["tensors"]) == [(1, 4, 16), (4, 8)]   # the matmul's 2-D view


def test_the_traced_qwen3_next_keeps_per_token_what_its_layers_kept_on_the_h100():
    """The committed trace of the Qwen3-Next rows' 16-layer config (data/hf-traces/: its activations read
    past one 64-token chunk, `memtrace.at_length`) keeps per token and layer what four of its layers
    kept on the H100 at 2 x 2048 (data/qwen3-next-saved/h100-2x2048.json: three linear-attention layers
    and one full-attention layer, the pattern the 16 repeat): (3 x 534,195 + 252,641) / 4 = 463,806 B,
    within 0.1%. Read within one chunk it kept 297 kB (data/README.md)."""
    import json

    import hf_traces    # tests/
    with open(os.path.join(ROOT, "data", "qwen3-next-saved", "h100-2x2048.json")) as f:
        layers = json.load(f)["layers"]
    assert [x["kind"] for x in layers] == ["linear_attention"] * 3 + ["full_attention"]
    measured = sum(x["bytes_per_token"] for x in layers) / 4
    assert measured == pytest.approx(463_806, abs=1)
    traced = []
    for path in hf_traces.traces():
        with open(path) as f:
            p = json.load(f)
        if p["model_type"] == "qwen3_next":
            traced.append(p["activations"]["bytes_per_token"] / p["dims"]["num_layers"])
    assert traced and all(t == pytest.approx(measured, rel=0.001) for t in traced)
