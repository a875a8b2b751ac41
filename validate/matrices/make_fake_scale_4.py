"""Writes the fourth scale call's fake-world matrices (validate/matrices/h200-fake4-*.json): Hugging Face
models as published (biases, MoE, a 256k vocabulary, fused projections), not the Llama shapes of the
earlier calls, at N = 16-256, stages 1-3, zero weights; chosen before any ran, to check the stage-3
fetch and free timing on models it was not fitted on:
    python validate/matrices/make_fake_scale_4.py validate/matrices"""
import json
import sys

ABOUT = ("rank 0 of a fake world of nproc ranks (validate run --fake-world), zero weights; the fourth "
         "scale call: published Hugging Face configs, held out from the stage-3 timing (data/README.md)")


def axes(stage, mb, seq, ck, gas=1, zi=None):
    a = {"stage": [stage], "micro_batch": [mb], "seq_len": [seq], "activation_checkpointing": [ck],
         "gas": [gas], "zero_weights": [True], "timed_steps": [1]}
    if zi is not None:
        a["zero_init"] = [zi]
    return a


MATRICES = {
    32: [("qwen2.5-7b", [axes(3, 2, 2048, True, 1, True), axes(3, 1, 4096, True, 2, True),
                         axes(2, 1, 2048, True, 2), axes(1, 4, 1024, True)])],
    256: [("mixtral-8x7b", [axes(3, 1, 4096, True, 1, True), axes(3, 2, 2048, True, 2, True)])],
    64: [("gemma-2-2b", [axes(3, 1, 2048, False, 1, False), axes(3, 2, 2048, True, 1, True)]),
         ("olmo-2-1b", [axes(1, 2, 2048, False)])],
    16: [("phi-3-mini-4k", [axes(2, 8, 1024, True), axes(3, 2, 2048, False, 2, True)])],
}

if __name__ == "__main__":
    for n, models in MATRICES.items():
        for name, hf_axes in models:
            m = {"about": ABOUT, "nproc": n, "hf_models": [{"config": name}], "hf_axes": hf_axes}
            if name == "gemma-2-2b":
                for a in hf_axes:
                    a["attention"] = ["eager"]
            json.dump(m, open(f"{sys.argv[1]}/h200-fake4-{name}-n{n}.json", "w"), indent=1)
            print(n, name, len(hf_axes))
