"""Writes the fifth scale call's fake-world matrices (validate/matrices/h200-fake5-*.json): held out from
the stage-3 fetch timing fitted on the earlier calls' rows, a seeded random sample of 1B/3B/8B/13B Llama
shapes at GPU counts no earlier row has (N = 24, 48, 96, 192, 384, 2048), stages 1-3, micro-batch 1-8,
sequence 512-4096, checkpointing, zero.Init and GAS 1-3, whose predicted reserved peak is under 15 GiB
so that seven lanes share the GPU (chosen before any ran):
    python validate/matrices/make_fake_scale_5.py validate/matrices"""
import itertools
import json
import random
import sys

from make_fake_scale import job

if __name__ == "__main__":
    from validate import jobs as J
    from zerocalc.estimate import estimate
    out = sys.argv[1]
    grid = [c for c in itertools.product(["1b", "3b", "8b", "13b"], [1, 2, 3], [24, 48, 96, 192, 384, 2048],
                                         [1, 2, 4, 8], [512, 1024, 2048, 4096], [False, True], [True, False],
                                         [1, 2, 3])
            if c[1] == 3 or c[6]]
    random.Random(5).shuffle(grid)
    by_n = {}
    for m, st, n, mb, seq, ck, zi, gas in grid:
        j = job(m, st, mb, seq, ck, gas=gas, zi=zi if st == 3 else None)
        spec, setup = J.to_zerocalc(J.make_job(J._architecture("", "", j["arch"]), n,
                                               **{k: v for k, v in j.items() if k != "arch"}))
        if estimate(spec, setup).peak_reserved_bytes > 15 * 2**30 or len(by_n.get(n, [])) >= 4:
            continue
        by_n.setdefault(n, []).append(j)
        if sum(map(len, by_n.values())) == 24:
            break
    for n, jobs in sorted(by_n.items()):
        json.dump({"about": "rank 0 of a fake world of nproc ranks (validate run --fake-world), zero weights; "
                   "the fifth scale call, a seeded random sample under 15 GiB predicted, held out (data/README.md)",
                   "nproc": n, "jobs": jobs}, open(f"{out}/h200-fake5-n{n}.json", "w"), indent=1)
        print(n, [(j["arch"]["hidden_size"], j["stage"], j["micro_batch"], j["seq_len"], j["gas"]) for j in jobs])
