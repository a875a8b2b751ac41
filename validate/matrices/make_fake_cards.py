"""Writes the emulated-card matrices from the configurations chosen near each card's boundary (zerocalc's
smallest capacity that runs them within 2-10% of the card's allocator capacity, about half above and
half below; `choose_cards.py` picks them):
    python validate/matrices/make_fake_cards.py validate/matrices                       # h200-cards-chosen.json
    python validate/matrices/make_fake_cards.py validate/matrices h200-cards-chosen-2.json h200-cards-set2
    python validate/matrices/make_fake_cards.py validate/matrices h200-cards-chosen-3.json h200-cards-set3   # HF configs
A card of G GiB leaves the allocator G·2^30 less the calibrated CUDA context (1,802,305,536 B on H200):
its jobs cap the caching allocator there (`allocator_capacity_bytes`, set_per_process_memory_fraction)."""
import json
import os
import sys
from collections import defaultdict

from make_fake_scale import job

CONTEXT_BYTES = 1_802_305_536

if __name__ == "__main__":
    out = sys.argv[1]
    chosen_name, prefix = (sys.argv[2], sys.argv[3]) if len(sys.argv) > 3 else ("h200-cards-chosen.json", "h200-cards")
    chosen = json.load(open(os.path.join(out, chosen_name)))
    by = defaultdict(list)
    for c in chosen:
        j = job(c["m"], c["st"], c["mb"], c["seq"], c["ck"], gas=c.get("gas", 1), zi=c["zi"] if c["st"] == 3 else None,
                allocator_capacity_bytes=c["card"] * 2**30 - CONTEXT_BYTES)
        by[c["card"], c["n"]].append(j)
    for (card, n), jobs in sorted(by.items()):
        json.dump({"about": f"a {card} GB card emulated (the allocator capped at {card} GiB less the context), rank 0 "
                   "of a fake world of nproc ranks, zero weights: OOM or not near the boundary (data/README.md)",
                   "nproc": n, "jobs": jobs}, open(os.path.join(out, f"{prefix}-{card}-n{n}.json"), "w"), indent=1)
