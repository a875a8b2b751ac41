"""Writes the fifth scale call's fake-world matrices (validate/matrices/h200-fake5-*.json): held out from
the stage-3 fetch timing fitted on the earlier calls' rows, a seeded random sample of 1B/3B/8B/13B Llama
shapes at GPU counts no earlier row has (N = 24, 48, 96, 192, 384, 2048), stages 1-3, micro-batch 1-8,
sequence 512-4096, checkpointing, zero.Init and GAS 1-3, whose predicted reserved peak is under 15 GiB
so that seven lanes share the GPU (chosen before any ran):
    python validate/matrices/make_fake_scale_5.py validate/matrices"""
import json
import sys

from make_fake_scale_3 import sample

if __name__ == "__main__":
    out = sys.argv[1]
    by_n = sample(["1b", "3b", "8b", "13b"], [24, 48, 96, 192, 384, 2048], [1, 2, 3], seed=5, per_n=4, total=24)
    for n, jobs in sorted(by_n.items()):
        json.dump({"about": "rank 0 of a fake world of nproc ranks (validate run --fake-world), zero weights; "
                   "the fifth scale call, a seeded random sample under 15 GiB predicted, held out (data/README.md)",
                   "nproc": n, "jobs": jobs}, open(f"{out}/h200-fake5-n{n}.json", "w"), indent=1)
        print(n, [(j["arch"]["hidden_size"], j["stage"], j["micro_batch"], j["seq_len"], j["gas"]) for j in jobs])
