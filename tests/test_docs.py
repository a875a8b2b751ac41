"""The README and docs/ are for users, and their numbers are the code's: the generated blocks (supported
models, the examples' output, the accuracy tables) equal what the code and the committed data give
now (`python -m validate docs` rewrites them), the README stays short, its test command is the one CI
runs, and every relative link resolves."""
import glob
import os
import re

import pytest

from validate import docs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def blocks(path):
    return [(m.group("name"), m.group("body")) for m in docs.BLOCK.finditer(read(path))]


def test_readme_is_at_most_10_kb():
    assert len(read("README.md").encode()) <= 10 * 1024


def test_the_readme_test_command_is_what_ci_runs():
    quick = read("README.md").split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = quick.strip().splitlines()
    assert len(lines) == 2 and lines[0] == "pip install . && zerocalc estimate --params 7e9 --dp 8"
    ci = read(".ci/run").splitlines()
    assert ci[-1].endswith(lines[1].removeprefix("pip install ")), (ci[-1], lines[1])


def test_user_documents_speak_of_the_project_not_its_history():
    # Evidence files keep their names (data/README.md is the lab record); prose does not cite issues,
    # sessions or the labels of past work.
    history = re.compile(r"\bissue\s*#?\d|\bsessions?\b|(?<![\w/.-])t\d{1,2}\b|\beleventh\b|grew from", re.I)
    for path in USER_DOCS:
        hits = [m.group(0) for m in history.finditer(read(path))]
        assert not hits, (path, hits)


def test_every_relative_link_resolves():
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    for path in USER_DOCS:
        for target in link.findall(read(path)):
            if "://" in target:
                continue
            resolved = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), target))
            assert resolved.startswith(ROOT + os.sep) and os.path.exists(resolved), (path, target)


def test_the_readme_has_its_sections():
    headings = re.findall(r"^## (.+)$", read("README.md"), re.M)
    assert headings[0] == "Quick start"
    for name in ("Examples", "What every column means", "Supported models", "Speed", "How far to trust it"):
        assert name in headings, name
    for page in ("docs/host-memory.md", "docs/lora.md", "docs/scale.md", "docs/accuracy.md"):
        assert f"]({page})" in read("README.md"), page


def test_generated_models_and_examples_are_current():
    from zerocalc import arch
    names = [name for path in docs.DOCUMENTS for name, _ in blocks(path)]
    # the README's five examples and docs/planning.md's 70B-on-64-H100s plan
    assert "models" in names and sum(n.startswith("example:") for n in names) == 6
    for path in docs.DOCUMENTS:
        for name, body in blocks(path):
            if not name.startswith("accuracy:"):
                assert body == docs.generate(name, rows=None) + "\n", f"{path}: {name} is stale: python -m validate docs"
    # every --model name in docs/models.md's list; the README gives their number
    words = set(dict(blocks("docs/models.md"))["models:names"].replace("*", " ").split())
    from zerocalc import resolve
    assert set(arch.PRESETS) <= words and {r["name"] for r in resolve.listing()} <= words
    assert f"**{len(resolve.listing())} models**" in dict(blocks("README.md"))["models"]


@pytest.mark.slow
def test_accuracy_tables_are_what_the_committed_data_give(committed_rows):
    for path in docs.DOCUMENTS:
        for name, body in blocks(path):
            if name.startswith("accuracy:"):
                assert body == docs.generate(name, lambda: committed_rows) + "\n", \
                    f"{path}: {name} is stale: python -m validate docs"


def test_the_summary_table_by_hand():
    pd = pytest.importorskip("pandas")
    from validate.report import markdown_by_stage, markdown_summary
    # Four GPU rows of stage 2, none offloaded, all started clean, none timed as training runs.
    # Peak allocated predicted 101, 98, 100, 120 against 100 each: errors 1%, 2%, 0%, 20%.
    ok = pd.DataFrame({"stage": [2] * 4, "now_state_bytes": [10] * 4, "measured_state_bytes": [10, 10, 10, 11],
                       "now_comm_bytes": [5] * 4, "measured_comm_bytes": [5] * 4,
                       "now_peak_allocated_bytes": [101, 98, 100, 120], "measured_peak_allocated_bytes": [100] * 4,
                       "measured_base_allocated_bytes": [0] * 4, "now_peak_reserved_bytes": [100] * 4,
                       "measured_peak_reserved_bytes": [100] * 4, "offload_optimizer": ["none"] * 4,
                       "offload_param": ["none"] * 4})
    table = markdown_summary(ok).splitlines()
    # errors 0, 0, 0, 1/11 = 9.09%: 95th percentile (linear) 0.85 * 9.09% = 7.73%
    assert table[2] == "| resident state bytes | 4 | 0 | 7.73% | 9.09% | 3 exact to the byte |"
    assert table[3] == "| communication bytes per step | 4 | 0 | 0 | 0 | 4 exact to the byte |"
    # median of 0, 1, 2, 20 % = 1.5%; 95th percentile (linear) = 2 + 0.85 * 18 = 17.3%; worst 20%
    assert table[4] == "| peak allocated | 4 | 1.50% | 17.3% | 20.0% | 3 within 5% |"
    by_stage = markdown_by_stage(ok, "now_peak_allocated_bytes", "measured_peak_allocated_bytes", 0.05)
    assert by_stage.splitlines()[2] == "| 2 | 4 | 3 | 1.50% | 17.3% | 20.0% |"


def test_speed_figures_are_ratios_to_the_cold_start_of_the_same_run():
    # The ratios are the run's (each the median of a case's paired ratios); the times are shown beside
    # them: estimate with an architecture 1.5×, the plan 1.8×, the sweep 1e6 configurations in 0.05 s =
    # 20M/s; the machine up to its first ';'.
    def case(key, name, wall_s, cpu_s, wall_ratio, cpu_ratio):
        return {"key": key, "case": name, "wall_s": wall_s, "cpu_s": cpu_s, "wall_ratio": wall_ratio,
                "cpu_ratio": cpu_ratio, "cpu_ratio_range": [cpu_ratio - 0.1, cpu_ratio + 0.2]}
    measured = {"machine": "2 cores, Some CPU; Python 3.11.7; load average 0.10 at the start", "date": "2026-01-02",
                "commit": "abc1234", "rounds": 3, "sweep_configurations": 1_000_000,
                "cases": [case("baseline", "P-only", 0.25, 0.20, 1.0, 1.0),
                          case("estimate-arch", "arch", 0.40, 0.30, 1.6, 1.5),
                          case("plan-70b", "plan", 0.50, 0.36, 2.0, 1.8),
                          case("sweep-later", "sweep", 0.05, 0.05, 0.2, 0.25)]}
    assert docs.speed("summary", measured) == (
        "2 cores, Some CPU, 2026-01-02, CPU time: `estimate --params 7e9 --dp 8` 200 ms cold; "
        "`--model llama-2-7b --seq-len 4096 --gpu h100` 1.5× that; the 70B `plan` 1.8×; `sweep` 20M configurations/s.")
    table = docs.speed("table", measured).splitlines()
    assert table[0].startswith("Measured on 2 cores, Some CPU (2026-01-02, commit abc1234), 3 rounds")
    assert table[-3] == "| arch | 400 ms | 1.60× | 300 ms | 1.50× | 1.40-1.70× |"
    # the same processes less their replays: the line under the table gives that case's ratio
    measured["cases"].append(case("estimate-arch-rest", "rest", 0.28, 0.18, 0.7, 0.9))
    table = docs.speed("table", measured).splitlines()
    assert table[-3] == "| rest | 280 ms | 0.70× | 180 ms | 0.90× | 0.80-1.10× |"
    assert table[-1].startswith("Less its replays, the `estimate --model llama-2-7b` case would take 0.90× the ")


def test_the_committed_speed_run_is_a_full_one():
    import json
    with open(docs.SPEED) as f:
        measured = json.load(f)
    assert measured["rounds"] >= 5 and measured["machine"].startswith(("1 cores", "2 cores"))
    assert all("cpu_ratio" in c and "wall_ratio" in c for c in measured["cases"])
    assert {"baseline", "estimate-arch", "plan-70b", "sweep-first", "sweep-later", "replay", "replay-arch",
            "estimate-arch-rest"} <= {c["key"] for c in measured["cases"]}
