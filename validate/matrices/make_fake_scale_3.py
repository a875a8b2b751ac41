"""Writes the third scale call's fake-world matrices (validate/matrices/h200-fake3-*.json): a random
sample of 1B/3B/8B Llama shapes over stage, N = 8-1024, micro-batch 1-8, sequence 512-4096,
checkpointing, zero.Init and GAS 1-2 whose predicted reserved peak is under 15 GiB, so that eight
lanes share the GPU (seeded; chosen before any ran):
    python validate/matrices/make_fake_scale_3.py validate/matrices"""
import itertools
import json
import random
import sys

from make_fake_scale import job


def sample(models, ns, gases, seed: int, per_n: int, total: int, cap_bytes: int = 15 * 2**30) -> dict:
    """{N: jobs}: the grid of models x stage x N x micro-batch x sequence x checkpointing x zero.Init x GAS
    (zero.Init at stage 3 only), shuffled by `seed`, taken in order where zerocalc predicts a reserved peak
    under `cap_bytes`, at most `per_n` jobs for each N, `total` in all."""
    from validate import jobs as J
    from zerocalc.estimate import estimate
    grid = [c for c in itertools.product(models, [1, 2, 3], ns, [1, 2, 4, 8], [512, 1024, 2048, 4096],
                                         [False, True], [True, False], gases)
            if c[1] == 3 or c[6]]
    random.Random(seed).shuffle(grid)
    by_n = {}
    for m, st, n, mb, seq, ck, zi, gas in grid:
        j = job(m, st, mb, seq, ck, gas=gas, zi=zi if st == 3 else None)
        spec, setup = J.to_zerocalc(J.make_job(J._architecture("", "", j["arch"]), n,
                                               **{k: v for k, v in j.items() if k != "arch"}))
        if estimate(spec, setup).peak_reserved_bytes > cap_bytes or len(by_n.get(n, [])) >= per_n:
            continue
        by_n.setdefault(n, []).append(j)
        if sum(map(len, by_n.values())) == total:
            break
    return by_n


if __name__ == "__main__":
    out = sys.argv[1]
    by_n = sample(["1b", "3b", "8b"], [8, 32, 128, 512, 1024], [1, 2], seed=11, per_n=7, total=35)
    for n, jobs in by_n.items():
        json.dump({"about": "rank 0 of a fake world of nproc ranks (validate run --fake-world), zero weights; "
                   "the third scale call, a seeded random sample under 15 GiB predicted (data/README.md)",
                   "nproc": n, "jobs": jobs}, open(f"{out}/h200-fake3-n{n}.json", "w"), indent=1)
        print(n, len(jobs))
