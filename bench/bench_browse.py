"""The browser's speed on a big run: 10,000 tapes in 5 files, through its HTTP API (no browser).

    uv run python bench/bench_browse.py [--tapes-per-file 2000] [--files 5] [--repeats 5]

Builds a run directory of synthetic tapes (tests/test_browse.py's), starts the browse server on it and
times: the first page (which indexes every file), then the next page, a sort by length, and opening the
last tape of the last file (which must not read the file whole). Prints the median seconds of each; the
targets the browser was built for: first page under 15 s, every later request under 2 s, the last tape as
fast as the first. The browser tests check what the pages show; the speed is measured here.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrate.after.browse import serve  # noqa: E402
from tapes.store import write_tapes  # noqa: E402
from tests.test_browse import synthetic_tape  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--tapes-per-file", type=int, default=2000)
    parser.add_argument("--files", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if min(args.tapes_per_file, args.files, args.repeats) <= 0:
        parser.error("--tapes-per-file, --files and --repeats must be > 0")

    root = Path(tempfile.mkdtemp(prefix="bench_browse_"))
    try:
        (root / "tapes").mkdir()
        for it in range(1, args.files + 1):
            write_tapes(
                root / "tapes" / f"iter_{it:06d}.jsonl", (synthetic_tape(i, it) for i in range(args.tapes_per_file))
            )
        (root / "config.json").write_text("{}")
        server = serve(root, port=0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        last = f"iter_{args.files:06d}.jsonl"

        def timed(path: str) -> float:
            start = time.perf_counter()
            response = httpx.get(url + path, timeout=120)
            response.raise_for_status()
            return time.perf_counter() - start

        first = timed("/api/tapes?kind=rollout&offset=0&limit=50")
        requests = {
            "next page": "/api/tapes?kind=rollout&offset=50&limit=50",
            "sort by length": "/api/tapes?kind=rollout&sort=-length&limit=50",
            "first tape": "/api/tape?file=iter_000001.jsonl&index=0",
            "last tape of the last file": f"/api/tape?file={last}&index={args.tapes_per_file - 1}",
        }
        times = {name: [timed(path) for _ in range(args.repeats)] for name, path in requests.items()}
        server.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    total = args.files * args.tapes_per_file
    print(f"{total} tapes in {args.files} files")
    print(f"  first page (indexes every file): {first:.2f} s (target < 15)")
    for name, values in times.items():
        print(f"  {name}: median {statistics.median(values) * 1000:.0f} ms over {args.repeats} (target < 2 s)")
    ratio = statistics.median(times["last tape of the last file"]) / statistics.median(times["first tape"])
    print(f"  last tape / first tape: x{ratio:.2f} (the last is read by its offset, not by reading the file)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
