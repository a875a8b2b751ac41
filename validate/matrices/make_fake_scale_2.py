"""Writes the fake-world matrices of the second scale call (validate/matrices/h200-fake2-*.json):
more of each axis at N >= 8 (stages 1-3, zero.Init on and off, GAS 1-4, checkpointing, micro-batch 1-8,
fp16 beside bf16, tied embeddings), the two largest models, and allocator histories of the two
configurations the first call's rows missed by more than 8% reserved."""
import json
import sys

from make_fake_scale import M, job

lanes = {  # lane -> {nproc: [jobs]}
 "big": {1024: [job("70b", 3, 2, 2048, True), job("405b", 3, 1, 1024, True)]},
 "d": {8: [job("8b", 3, 1, 2048, True), job("8b", 3, 1, 2048, True, zi=False), job("3b", 1, 2, 1024, True, gas=4),
           job("3b", 2, 1, 2048, False, dtype="fp16")],
       32: [job("8b", 3, 2, 1024, False), job("3b", 3, 1, 4096, True, gas=4), job("7b", 3, 4, 1024, True, zi=False)]},
 "e": {64: [job("1bt", 2, 4, 2048, True), job("1bt", 3, 4, 1024, False), job("3b", 1, 1, 2048, False),
            job("3b", 2, 4, 1024, True, gas=2), job("3b", 3, 1, 2048, False, zi=False), job("3b", 3, 4, 2048, True, dtype="fp16")],
       128: [job("1b", 2, 8, 512, False), job("1b", 3, 8, 1024, True, gas=2), job("8b", 3, 1, 4096, True)]},
 "f": {256: [job("1b", 1, 2, 2048, False), job("1b", 2, 1, 4096, True, gas=3), job("3b", 3, 8, 512, False),
             job("3b", 3, 2, 2048, True, zi=False), job("8b", 3, 2, 2048, True, gas=2)],
       1024: [job("3b", 1, 4, 1024, True), job("3b", 2, 1, 2048, False), job("1b", 3, 4, 2048, True, gas=2),
              job("8b", 3, 1, 2048, False)]},
}
histories = {16: [job("8b", 2, 1, 2048, False)], 8: [job("1b", 2, 2, 2048, False, gas=2)]}
out = sys.argv[1]
about = "rank 0 of a fake world of nproc ranks (validate run --fake-world), zero weights; the second scale call (data/README.md)"
for lane, by_n in lanes.items():
    for n, jobs in by_n.items():
        json.dump({"about": about, "nproc": n, "jobs": jobs}, open(f"{out}/h200-fake2-{lane}-n{n}.json", "w"), indent=1)
for n, jobs in histories.items():
    json.dump({"about": about + "; allocator histories (VALIDATE_SNAPSHOT_SCOPE=warmup)", "nproc": n, "jobs": jobs},
              open(f"{out}/h200-fake2-hist-n{n}.json", "w"), indent=1)
