"""What the benchmark scripts' reports share, whatever they measure: the commit that made the numbers,
markdown tables, and the markdown + JSON pair a run leaves behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The commit the numbers come from: ``$GAAC_COMMIT`` where the run sets it (a device machine's copy of the
    tree carries the git metadata of the checkout it was sent from, not of its last commit), else HEAD's short
    hash, or ``unknown`` without git."""
    if os.environ.get("GAAC_COMMIT"):
        return os.environ["GAAC_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def commit_with_changes(script: str) -> str:
    """HEAD's hash and the files of gaac/ and ``script`` that differ from it: a report made by uncommitted
    code says so, since HEAD alone would not reproduce its numbers."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout

    head = git("rev-parse", "--short=12", "HEAD").strip() or "unknown"
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "gaac", script).splitlines()]
    return head + (f" (uncommitted changes in: {', '.join(dirty)})" if dirty else "")


def gpu_report(script: str, argv, args, **extra) -> dict:
    """The header of a GPU script's report: date, device, machine, commit, torch, the command (``script`` and
    ``argv``, or the process's arguments where ``argv`` is None), the parsed ``args`` and ``extra`` fields."""
    import datetime
    import platform

    import torch

    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                device=torch.cuda.get_device_name(), machine=f"{platform.machine()} {os.cpu_count()} cores",
                commit=commit(), torch=torch.__version__, **extra,
                command=f"python benchmarks/{script} " + " ".join(sys.argv[1:] if argv is None else argv),
                args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})


def gpu_run(script: str, doing: str, argv, args, measure, render, **extra) -> dict:
    """A GPU script's run: refused without CUDA or under numba's simulator (``doing`` says what the script does
    on the GPU), else its :func:`gpu_report` header with ``measure(args)`` as ``results``, written to ``args.out``
    (:func:`write`) and printed.  Returns the report."""
    import torch

    if not torch.cuda.is_available() or os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        raise SystemExit(f"{script} {doing} on a GPU: it needs CUDA and NUMBA_ENABLE_CUDASIM unset")
    rep = gpu_report(script, argv, args, **extra)
    rep["results"] = measure(args)
    write(rep, args.out, render)
    print(render(rep))
    return rep


def head(title: str, rep: dict) -> list[str]:
    """A report's first lines: its title, then the date, device, commit and command of ``rep``."""
    return [f"# {title}", "", f"- date: {rep['date']}", f"- device: {rep['device']}", f"- commit: {rep['commit']}",
            f"- command: `{rep['command']}`"]


def table(header, rows) -> list[str]:
    """The lines of a markdown table: the header, its ``|---|`` rule (one per header cell, so the two
    cannot disagree) and a line per row of cells (each written as ``str`` would)."""
    def line(cells):
        return "| " + " | ".join(map(str, cells)) + " |"

    return [line(header), "|---" * len(header) + "|", *map(line, rows)]


def write(rep: dict, out: Path, render) -> None:
    """The markdown ``render(rep)`` to ``out`` and ``rep`` as JSON beside it; the scripts call it after every
    case, so that a run cut short still leaves what it measured."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rep, indent=1))
    out.write_text(render(rep))


def timeline(spans, join_us: float = 200.0, idle_us: float = 500.0) -> dict:
    """A GPU timeline from ``spans`` ``[(start_us, end_us, name)]`` (kernels and copies, as torch's profiler
    gives them, in any order): ``runs``, consecutive spans of one name less than ``join_us`` apart merged into
    ``[start, end, count, name]`` (from the first span's start); ``busy_us``, the time some span ran (overlaps
    counted once); ``span_us``, first start to last end; ``idle``, the gaps of ``idle_us`` or more in which
    nothing ran, as ``[start, end, name before, name after]``."""
    spans = sorted((float(a), float(b), str(n)) for a, b, n in spans)
    if not spans:
        return {"runs": [], "busy_us": 0.0, "span_us": 0.0, "idle": []}
    t0 = spans[0][0]
    runs, idle, busy = [], [], 0.0
    reach, last = t0, spans[0][2]
    for a, b, name in spans:
        if a - reach >= idle_us:
            idle.append([reach - t0, a - t0, last, name])
        busy += max(0.0, b - max(a, reach))
        if b > reach:
            reach, last = b, name
        if runs and runs[-1][3] == name and a - t0 - runs[-1][1] < join_us:
            runs[-1][1], runs[-1][2] = max(runs[-1][1], b - t0), runs[-1][2] + 1
        else:
            runs.append([a - t0, b - t0, 1, name])
    return {"runs": runs, "busy_us": busy, "span_us": reach - t0, "idle": idle}
