"""bench/results/: every result file under the folder of the script that wrote it, its provenance recorded by one
helper (bench/provenance.py), and an index (bench/index.py) that is current: a file added, moved or cited
differently fails here until `uv run python bench/index.py` is run again."""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import index  # noqa: E402
import provenance  # noqa: E402


def test_the_committed_index_is_what_the_generator_writes_now():
    assert index.INDEX.read_text() == index.render(index.entries()), "run: uv run python bench/index.py"


def test_every_result_file_outside_uncited_is_cited_by_a_page():
    rows = index.entries()
    assert rows, "no result file under bench/results/"
    uncited = [r["path"] for r in rows if not r["sections"] and not r["uncited_folder"]]
    assert not uncited, f"cite these in docs/ or move them to bench/results/uncited/SCRIPT/: {uncited}"


def test_every_results_folder_is_a_script_that_records_provenance():
    """A folder of bench/results/ is a bench script's name (or a WRITERS entry), and that script writes through
    bench/provenance.py (itself, or through bench/compare_algorithms.py's report)."""
    for folder in sorted(p for p in index.RESULTS.iterdir() if p.is_dir() and p.name != index.UNCITED):
        if folder.name in index.WRITERS:
            continue
        script = ROOT / "bench" / f"{folder.name}.py"
        assert script.is_file(), f"bench/results/{folder.name}/: no bench/{folder.name}.py"
        text = script.read_text()  # its own writes, or compare_algorithms' report (which writes the sidecars)
        assert "from provenance import" in text or "import compare_algorithms" in text, (
            f"{script.name} does not write through provenance.py"
        )


def test_a_citation_names_a_file_by_path_stem_glob_or_folder():
    path = "bench/results/bench_gpu_learner/gpu_learner_h200.log"
    assert index.cites(path, path)
    assert index.cites("bench/results/bench_gpu_learner/gpu_learner_*_h200.*", path.replace("_h200", "_lora_h200"))
    assert index.cites("bench/results/bench_gpu_learner/", path)
    assert not index.cites("bench/results/bench_gpu_learner/gpu_learner_h200.json", path)
    assert not index.cites("bench/results/bench_gpu", path)  # a prefix that is not a folder
    page = ROOT / "docs" / "benchmarks.md"
    found = index.citations(page)
    assert ("bench/results/bench_eval_overlap/eval_overlap_embedded-split.json",
            "docs/benchmarks.md#evaluation-beside-training-benchbench_eval_overlappy") in found  # fmt: skip


def test_provenance_records_date_commit_command_and_machine(tmp_path):
    written = provenance.write_json(tmp_path / "x.json", {"ratio": 1.5}, argv=["bench/bench_x.py", "--a", "b c"])
    record = json.loads(written.read_text())
    assert record["ratio"] == 1.5
    made = record["provenance"]
    assert made["command"] == "python bench/bench_x.py --a 'b c'"
    assert made["date"][:2] == "20" and made["date"].endswith("+00:00")
    assert made["commit"] is None or len(made["commit"]) == 40
    assert made["machine"]["cores"] == os.cpu_count() and made["machine"]["cpu"]
    assert isinstance(made["machine"]["gpus"], list)
    side = provenance.write_sidecar(tmp_path / "plot.png", argv=["bench/bench_x.py"])
    assert side.name == "plot.provenance.json" and json.loads(side.read_text())["file"] == "plot.png"
    assert provenance.results_dir(ROOT / "bench" / "bench_trees.py") == ROOT / "bench" / "results" / "bench_trees"
