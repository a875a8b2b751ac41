"""Runs memory-only matrices side by side on one GPU, each started as soon as the GPU has room for it:
a matrix's room is the most any of its jobs may hold (an emulated card's capacity, or a bound on its
reserved peak), and the matrices running at once never hold more than the GPU does, so a capped job
never meets a real out-of-memory. Rows go to OUT/NAME.csv as each job finishes (`validate run`).

    python3 validate/gpu/pack.py SECONDS ROOM_GIB OUT ITEM...
    ITEM: [~]NPROC[f[RANK]]:MATRIX:GIB[:VAR=VALUE,...]   (f: --fake-world, as rank RANK (--fake-rank) where
          given, else rank 0; GIB: the matrix's room)

Items are tried in the order given, each started when it fits beside those running; an item marked ~
only once every unmarked one has started; none starts after SECONDS. Each job may run 400 s
(PACK_JOB_TIMEOUT=SECONDS for longer ones, e.g. a 70B shape's full micro-batch on rank 0 of a fake world)."""
import os
import subprocess
import sys
import time

JOB_TIMEOUT_S = os.environ.get("PACK_JOB_TIMEOUT", "400")


def parse(item: str) -> dict:
    later = item.startswith("~")
    world, matrix, gib, *env = item.lstrip("~").split(":", 3)
    extra = dict(kv.split("=", 1) for kv in env[0].split(",")) if env else {}
    nproc, fake, rank = world.partition("f")
    return {"nproc": nproc, "fake": bool(fake), "rank": rank or "0", "matrix": matrix, "gib": float(gib), "env": extra,
            "later": later}


def main(seconds: float, room_gib: float, out: str, items: list[str]) -> None:
    deadline, queue, running = time.time() + seconds, [parse(i) for i in items], []
    while queue or running:
        running = [(p, it) for p, it in running if p.poll() is None]
        used = sum(it["gib"] for _, it in running)
        for it in list(queue):
            left = deadline - time.time()
            if left < 30:
                print(f"no time left for {it['matrix']}", flush=True)
                queue.remove(it)
            elif it["later"] and any(not q["later"] for q in queue):
                continue
            elif used + it["gib"] <= room_gib:
                name = os.path.basename(it["matrix"]).removesuffix(".json")
                cmd = ["timeout", str(int(left)), sys.executable, "-m", "validate", "run", "--backend", "cuda",
                       "--nproc", it["nproc"], "--include", "localhost:0", "--matrix", it["matrix"], "--timeout", JOB_TIMEOUT_S,
                       "--out", os.path.join(out, name + ".csv")] + (["--fake-world", "--fake-rank", it["rank"]] if it["fake"] else [])
                with open(os.path.join(out, name + ".log"), "w") as log:   # the child keeps its own copy
                    running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                     env={**os.environ, **it["env"]}), it))
                print(f"{time.time() - deadline + seconds:5.0f} s: {name} ({it['gib']:.0f} GiB; {used + it['gib']:.0f} in use)",
                      flush=True)
                used += it["gib"]
                queue.remove(it)
        time.sleep(1)


if __name__ == "__main__":
    main(float(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4:])
