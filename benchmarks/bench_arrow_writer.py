"""Arrow file writers of ``pack_dataset``, side by side: ``O_DIRECT`` with in-place messages vs pyarrow's own writer.

What it measures: ``padfree.data.hf.pack_dataset(ds, 2048, cache_file_name=...)`` on the dataset of
``bench_datasets.py`` (lognormal lengths, median 250, sigma 1, seed 0, clipped to C = 2048; dummy int32 ids;
``save_to_disk`` then ``load_from_disk``, memory-mapped) at its two sizes (1M rows, and the 100k rows of its
``--quick``), for two outputs (the default columns padded to C, and TRL's ``input_ids`` + ``seq_lengths``
unpadded), with each file writer of :mod:`padfree.data._arrow_writer` (``PADFREE_ARROW_WRITER``):

- ``direct``: ``O_DIRECT`` from two staging buffers, rows laid out in place inside flatbuffer-patched messages;
- ``buffered``: pyarrow's stream writer through the page cache, overlapped with building, pages dropped behind it;
- ``plain``: pyarrow's stream writer, one chunk after the other, nothing else.

Every run is a fresh subprocess: load the dataset, pack a tiny one to a file with the same writer (imports, numba
kernels, first-call costs off the clock), read the RSS, time one call (wall with ``time.perf_counter``, CPU as user
+ system time of all threads), read the peak RSS (``VmHWM``), count the bytes of the file and how many of them are
in the page cache (``fincore``), then ``fsync`` the file (timed apart: what the page-cache writers leave the disk to
do after they return) and delete it. The writers alternate run by run, in a rotating order.

Run it (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_arrow_writer.py           # ~8 minutes on 2 cores, ~4 GB of RAM, ~8 GB of disk
    python benchmarks/bench_arrow_writer.py --quick   # the small dataset only, 2 runs: a smoke test

Only the section between ``<!-- bench_arrow_writer:start -->`` and ``<!-- bench_arrow_writer:end -->`` of the output
file is replaced.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import load_snapshot, machine, peak_rss, rss, table, write_section
from bench_datasets import CAPACITY, disk_throughput, make_dataset, warm_page_cache

REPO = Path(__file__).resolve().parents[1]
START_MARK = "<!-- bench_arrow_writer:start -->"
END_MARK = "<!-- bench_arrow_writer:end -->"
AFTER_MARK = "<!-- bench_datasets:end -->"
WRITERS = ("direct", "buffered", "plain")
OUTPUTS = {
    "default": ({}, "default: 4 columns padded to C + `seq_lens`"),
    "trl": ({"padding": None, "columns": {"input_ids": "input_ids", "seq_lens": "seq_lengths"}},
            "TRL's: `input_ids` + `seq_lengths`, unpadded"),
}
CLEARLY = 1.3  # the O_DIRECT writer stays only if it is this much faster, or this much lighter, on the large case


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------------------
# The worker: one timed call in a fresh process (PADFREE_ARROW_WRITER set by the parent)
# ------------------------------------------------------------------------------------------------------------------


def resident_bytes(path: str) -> int:
    """Bytes of ``path`` in the page cache (util-linux ``fincore``); -1 where it is not installed."""
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", path], capture_output=True,
                             text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return -1
    return int(out.stdout.split()[0])


def worker(data: str, output: str, config: dict) -> dict:
    import datasets

    from padfree.data.hf import pack_dataset

    datasets.disable_progress_bars()
    ds = datasets.load_from_disk(data)
    tiny = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 2_000}).cast_column(
        "input_ids", datasets.List(datasets.Value("int32")))
    pack_dataset(tiny, 64, cache_file_name=output + ".warm", **config)
    os.remove(output + ".warm")
    before = rss()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    out = pack_dataset(ds, CAPACITY, cache_file_name=output, **config)
    seconds = time.perf_counter() - started
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    peak = peak_rss()
    report = {
        "seconds": seconds,
        "cpu_seconds": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
        "peak_growth": peak - before,
        "rows": len(out),
        "bytes": os.path.getsize(output),
        "cached": resident_bytes(output),
    }
    del out
    fd = os.open(output, os.O_RDONLY)
    started = time.perf_counter()
    os.fsync(fd)
    report["fsync_seconds"] = time.perf_counter() - started
    os.close(fd)
    os.remove(output)
    return report


def run_worker(writer: str, data: Path, output: Path, config: dict) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--data", str(data), "--output", str(output),
           "--config", json.dumps(config)]
    env = {**os.environ, "PADFREE_ARROW_WRITER": writer}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{writer} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------------------------


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def spread(runs: list[dict], key: str, scale: float = 1.0, digits: int = 2) -> str:
    values = [r[key] / scale for r in runs]
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def render(args, info, before, after, sizes, disk, results, elapsed) -> str:
    rows, ratios, verdicts = [], [], []
    for (n, output), by_writer in results.items():
        data = sizes[n]
        for writer, runs in by_writer.items():
            cached = statistics.median(r["cached"] for r in runs)
            rows.append([f"{n:,}", OUTPUTS[output][1], f"`{writer}`", str(len(runs)), spread(runs, "seconds"),
                         spread(runs, "cpu_seconds"), spread(runs, "peak_growth", 1e9),
                         f"{med(runs, 'peak_growth') / data['token_bytes']:.2f}", f"{runs[0]['bytes'] / 1e9:.3f}",
                         "–" if cached < 0 else f"{cached / 1e9:.2f}", spread(runs, "fsync_seconds")])
        direct = by_writer["direct"]
        for other in ("buffered", "plain"):
            theirs = by_writer[other]
            wall = med(theirs, "seconds") / med(direct, "seconds")
            cpu = med(theirs, "cpu_seconds") / med(direct, "cpu_seconds")
            peak = med(theirs, "peak_growth") / med(direct, "peak_growth")
            ratios.append([f"{n:,}", OUTPUTS[output][1], f"`{other}` / `direct`", f"{wall:.2f}", f"{cpu:.2f}",
                           f"{peak:.2f}"])
            if n == max(sizes):
                clearly = wall >= CLEARLY or peak >= CLEARLY
                verdicts.append([OUTPUTS[output][1], f"`{other}`", f"{wall:.2f}× the wall time, {peak:.2f}× the "
                                 f"peak RSS", "**yes**" if clearly else "**no**"])
    largest = sizes[max(sizes)]
    lines = [
        START_MARK,
        "## Arrow file writers of `pack_dataset` (`benchmarks/bench_arrow_writer.py`)",
        "",
        f"_Generated by `python benchmarks/bench_arrow_writer.py{' --quick' if args.quick else ''}` on "
        f"{dt.datetime.now().strftime('%Y-%m-%d %H:%M')} (commit {info['commit']}); the whole run took "
        f"{elapsed / 60:.1f} min. Regenerating replaces only this section._",
        "",
        "### Machine and conditions",
        "",
        f"- CPU: {info['cpu']}, {info['cores']}, {info['memory']} RAM; {info['os']}",
        f"- Versions: {info['versions']}",
        f"- Load at start: {before}. At end: {after}. **The machine's cores were shared with other work during the "
        "run** (other engineers' test suites): wall times move with it; CPU times much less. The writers alternate "
        "run by run, in a rotating order, so that they share the conditions.",
        f"- Disk (the dataset's and the outputs'): sequential writes of 64 MiB at {disk['direct'] / 1e9:.2f} GB/s "
        f"with `O_DIRECT`, {disk['buffered'] / 1e9:.2f} GB/s through the page cache (with `fsync`), measured at "
        "the start of the run.",
        f"- Data: `bench_datasets.py`'s: lognormal lengths (median 250, sigma 1, seed 0), clipped to C = {CAPACITY}, "
        f"dummy int32 ids; the large case is {largest['n']:,} rows, {largest['tokens']:,} tokens = "
        f"{largest['token_bytes'] / 1e9:.2f} GB of token bytes in {largest['files']} Arrow files; "
        + "; ".join(f"{d['n']:,} rows: {d['token_bytes'] / 1e9:.3f} GB" for d in sizes.values())
        + ". Saved with `save_to_disk`, loaded with `load_from_disk` (memory-mapped), read once before the first "
        "run so that every run finds the input in the page cache.",
        "- Writers (`PADFREE_ARROW_WRITER`): `direct` = `O_DIRECT` from two staging buffers, the rows laid out in "
        "place inside flatbuffer-patched IPC messages; `buffered` = pyarrow's stream writer through the page cache, "
        "chunk k + 1 built while chunk k is written, written pages dropped with `POSIX_FADV_DONTNEED`; `plain` = "
        "pyarrow's stream writer, chunk after chunk, nothing else. All three write the same bytes.",
        f"- Method: every run is a fresh subprocess that loads the dataset, packs a tiny one with the same writer "
        "(first-call costs off the clock), then times `pack_dataset(ds, 2048, cache_file_name=...)`: wall "
        "(`time.perf_counter`), CPU (user + system, all threads, `getrusage`), peak RSS (`VmHWM` minus the RSS "
        "just before the call). Then, off the clock: the output's bytes in the page cache (`fincore`) and an "
        "`fsync` of the file (timed: the disk writing the page-cache writers leave behind when they return; the "
        f"next run starts with a clean disk queue). {args.runs} runs per writer and case; median (range).",
        "",
        "### Results",
        "",
        table(["rows", "output", "writer", "runs", "wall s", "CPU s", "peak RSS GB", "peak RSS / token bytes",
               "file GB", "in page cache GB", "fsync s"], rows, "lllrrrrrrrr"),
        "",
        "Ratios of medians (> 1: `direct` is faster / lighter):",
        "",
        table(["rows", "output", "ratio", "wall", "CPU", "peak RSS"], ratios, "lllrrr"),
        "",
        f"Does `direct` pay for its complexity, i.e. is it at least {CLEARLY}× faster or {CLEARLY}× lighter in "
        "peak RSS than pyarrow's own writer on the large case?",
        "",
        table(["output", "vs", "that writer needs", f"≥ {CLEARLY}×"], verdicts, "llll"),
        "",
        END_MARK,
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="See the module docstring for what is measured and how.")
    parser.add_argument("--quick", action="store_true", help="the 100k-row dataset only, 2 runs: a smoke test")
    parser.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md", help="file whose section is (re)written")
    parser.add_argument("--runs", type=int, default=None, help="runs per writer and case (3, quick 2)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the datasets are saved (default: a temp dir)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--config", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.runs = args.runs or (2 if args.quick else 3)
    args.sizes = (100_000,) if args.quick else (1_000_000, 100_000)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.data, args.output, json.loads(args.config))))
        return
    began = time.perf_counter()
    info = machine(("numpy", "numba", "padfree", "datasets", "pyarrow"))
    before = load_snapshot()
    workdir = Path(tempfile.mkdtemp(prefix="padfree-bench-arrow-writer-", dir=args.workdir))
    try:
        sizes = {}
        for n in args.sizes:
            log(f"saving {n:,} rows")
            sizes[n] = make_dataset(n, workdir / f"data-{n}")
        disk = disk_throughput(workdir, 1 << 30)
        log(f"disk: {disk['direct'] / 1e9:.2f} GB/s O_DIRECT, {disk['buffered'] / 1e9:.2f} GB/s buffered")
        for n in args.sizes:
            warm_page_cache(workdir / f"data-{n}")
        results = {(n, output): {w: [] for w in WRITERS} for n in args.sizes for output in OUTPUTS}
        for r in range(args.runs):
            order = WRITERS[r % len(WRITERS):] + WRITERS[: r % len(WRITERS)]
            for (n, output), by_writer in results.items():
                for writer in order:
                    report = run_worker(writer, workdir / f"data-{n}", workdir / "out.arrow", OUTPUTS[output][0])
                    by_writer[writer].append(report)
                    log(f"run {r + 1}: {n:,} rows, {output}, {writer}: {report['seconds']:.2f} s wall, "
                        f"{report['cpu_seconds']:.2f} s CPU, peak RSS +{report['peak_growth'] / 1e9:.2f} GB, "
                        f"fsync {report['fsync_seconds']:.2f} s")
        for by_writer in results.values():  # the same rows from every writer
            assert len({(run["rows"], run["bytes"]) for runs in by_writer.values() for run in runs}) == 1
        after = load_snapshot()
        elapsed = time.perf_counter() - began
        write_section(args.out, render(args, info, before, after, sizes, disk, results, elapsed), START_MARK,
                      END_MARK, AFTER_MARK)
        log(f"done in {elapsed / 60:.1f} min; wrote {args.out}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
