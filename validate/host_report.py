"""The host-memory rows against the current zerocalc: measured peak resident set per rank (VmHWM) beside
`zerocalc.host`'s prediction, and pinned bytes beside the modelled pinned blocks."""
from validate import results_file, schema
from validate.jobs import to_zerocalc
from validate.rows import job_from_row
from zerocalc import host

GiB = 2**30


def host_rows(paths: list[str]) -> list[dict]:
    """Every ok row of `paths` that measured the host: its configuration, measured and predicted bytes.
    Raises ResultsFileError for a file that is not a results file or holds a row no validator wrote
    (`schema.read_checked`)."""
    out = []
    for path in paths:
        parsed = schema.read_checked(path)
        for r, line in zip(parsed.rows, parsed.lines):
            if r["outcome"] != "ok" or not r.get("measured_host_peak_bytes"):
                continue
            measured = int(float(r["measured_host_peak_bytes"]))
            if measured <= 0:
                raise results_file.ResultsFileError(f"{path}, line {line}, column measured_host_peak_bytes: "
                                                    f"{measured} is not a peak resident set")
            job = job_from_row(r)
            spec, setup = to_zerocalc(job)
            h = host.host_memory(spec, setup)
            at_run = r.get("predicted_host_peak_bytes")
            out.append({"row": r, "job": job, "num_params": spec.num_params, "measured": measured, "predicted": h.peak_bytes,
                        "at_run": int(float(at_run)) if at_run else None,
                        "pinned": int(float(r.get("measured_host_pinned_bytes") or 0)),
                        "predicted_pinned": h.pinned_bytes, "phase": h.peak_phase})
    return out


def markdown_table(rows: list[dict]) -> str:
    """One line per row: the configuration, measured and predicted host peak (GiB, error), the
    prediction committed before the run, and pinned bytes measured / modelled."""
    lines = ["| model | P | stage | dtype | offload (opt/param) | GAS | zero.Init | measured GiB | predicted GiB | error "
             "| before the run | pinned measured / modelled GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        j = x["job"]
        err = (x["predicted"] - x["measured"]) / x["measured"]
        pre = f"{(x['at_run'] - x['measured']) / x['measured']:+.1%}" if x["at_run"] else "-"
        lines.append(f"| {j['arch']['family']} | {x['num_params'] / 1e9:.3f}B | {j['stage']} | {j['dtype']} | "
                     f"{j['offload_optimizer']}/{j['offload_param']} | {j['gas']} | {j['zero_init']} | "
                     f"{x['measured'] / GiB:.2f} | {x['predicted'] / GiB:.2f} | {err:+.1%} | {pre} | "
                     f"{x['pinned'] / GiB:.2f} / {x['predicted_pinned'] / GiB:.2f} |")
    errs = [abs(x["predicted"] - x["measured"]) / x["measured"] for x in rows]
    pres = [abs(x["at_run"] - x["measured"]) / x["measured"] for x in rows if x["at_run"]]
    lines.append("")
    lines.append(f"{sum(e <= 0.10 for e in errs)} of {len(rows)} within 10% (worst {max(errs):.1%}, mean {sum(errs) / len(errs):.1%}); "
                 f"before the run {sum(e <= 0.10 for e in pres)} of {len(pres)}" + (f" (worst {max(pres):.1%})." if pres else "."))
    return "\n".join(lines)
