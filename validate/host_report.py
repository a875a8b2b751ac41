"""The host-memory rows against the current zerocalc: measured peak resident set per rank (VmHWM) beside
`zerocalc.host`'s prediction, and pinned bytes beside the modelled pinned blocks."""
import csv

from validate.jobs import to_zerocalc
from validate.rows import job_from_row
from zerocalc import host

GiB = 2**30


def host_rows(paths: list[str]) -> list[dict]:
    """Every ok row of `paths` that measured the host: its configuration, measured and predicted bytes."""
    out = []
    for path in paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                if r.get("outcome") != "ok" or not r.get("measured_host_peak_bytes"):
                    continue
                spec, setup = to_zerocalc(job_from_row(r))
                h = host.host_memory(spec, setup)
                out.append({"row": r, "num_params": spec.num_params, "measured": int(r["measured_host_peak_bytes"]),
                            "predicted": h.peak_bytes, "at_run": int(r["predicted_host_peak_bytes"]),
                            "pinned": int(float(r["measured_host_pinned_bytes"] or 0)),
                            "predicted_pinned": h.pinned_bytes, "phase": h.peak_phase})
    return out


def markdown_table(rows: list[dict]) -> str:
    """One line per row: the configuration, measured and predicted host peak (GiB, error), the
    prediction committed before the run, and pinned bytes measured / modelled."""
    lines = ["| model | P | stage | dtype | offload (opt/param) | GAS | zero.Init | measured GiB | predicted GiB | error "
             "| before the run | pinned measured / modelled GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        r = x["row"]
        err = (x["predicted"] - x["measured"]) / x["measured"]
        pre = (x["at_run"] - x["measured"]) / x["measured"]
        lines.append(f"| {r['family']} | {x['num_params'] / 1e9:.3f}B | {r['stage']} | {r['dtype']} | "
                     f"{r['offload_optimizer']}/{r['offload_param']} | {r['gas']} | {r['zero_init']} | "
                     f"{x['measured'] / GiB:.2f} | {x['predicted'] / GiB:.2f} | {err:+.1%} | {pre:+.1%} | "
                     f"{x['pinned'] / GiB:.2f} / {x['predicted_pinned'] / GiB:.2f} |")
    errs = [abs(x["predicted"] - x["measured"]) / x["measured"] for x in rows]
    pres = [abs(x["at_run"] - x["measured"]) / x["measured"] for x in rows]
    lines.append("")
    lines.append(f"{sum(e <= 0.10 for e in errs)} of {len(rows)} within 10% (worst {max(errs):.1%}, mean {sum(errs) / len(errs):.1%}); "
                 f"before the run {sum(e <= 0.10 for e in pres)} of {len(rows)} (worst {max(pres):.1%}).")
    return "\n".join(lines)
