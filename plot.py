"""Several runs' loss curves in one picture.

    python plot.py RUN_DIR [RUN_DIR ...] [--x step|tokens] [--out FILE.png] [--overwrite]

Each run directory (a local path or a URL, gs://bucket/runs/x) is read through its metrics.jsonl, the
log train.py writes (rundir.Run.logged): its training loss at every logged step as a thin line and its
validation loss at each evaluation as points joined, both in the run's own colour and labelled with its
name (the directory's name; the whole location where two runs share a name). The x-axis is the step, or
with `--x tokens` the tokens trained, to compare runs of other batch sizes or contexts by the data they
saw. The figure is drawn by training/plots.py, as each run's own loss.png is.

The picture goes to --out, by default loss-A-vs-B.png (the runs' names) in the current directory; a
local path or a URL. A file already there is never replaced silently: an existing --out is refused
unless --overwrite is given, and --overwrite replaces only a PNG file. The file is written whole (a
temporary file renamed) or not at all.

User errors (a run that is not there, a directory without metrics.jsonl, a run given twice, --x tokens
on a log without tokens, an --out that is not a .png or would replace another kind of file) end in one
`error: ...` line on stderr and exit status 2, before anything is written.
"""
from __future__ import annotations

from core import errors  # light: nothing but the standard library

if __name__ == "__main__":
    errors.stop_at_once_while_loading()  # a Ctrl-C while the modules load: one line, no traceback

from training import plots  # light too: matplotlib loads when a figure is drawn

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"  # the first bytes of every PNG file


def parse_args(argv):
    p = errors.ArgumentParser(error=errors.PlotError,
                              description="Draw several runs' training and validation loss in one PNG.",
                              hint="usage: python plot.py RUN_DIR [RUN_DIR ...] [--x step|tokens] [--out FILE.png] "
                                   "[--overwrite]")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (local paths or URLs) to draw")
    p.add_argument("--x", choices=tuple(plots.X_AXES), default="step",
                   help="the x-axis: the step, or the tokens trained (default: %(default)s)")
    p.add_argument("--out", default=None,
                   help="the PNG to write (default: loss-A-vs-B.png, the runs' names, in the current directory)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (only ever a PNG file)")
    args = p.parse_args(argv)
    if args.out is not None and not args.out.lower().endswith(".png"):
        raise errors.PlotError(f"--out must name a .png file, got {args.out!r}")
    return args


if __name__ == "__main__":
    errors.parse_before_loading(parse_args)  # --help and argument mistakes: at once, before anything loads

import math
import os
import pathlib
import re
import sys

from core import storage
from store import rundir


def labels(runs: list[rundir.Run], given: list[str]) -> list[str]:
    """Each run's label: its directory's name, or the location as given where two runs share a name; a
    run given twice is a PlotError."""
    where = [str(run.dir) if run.dir.remote else os.path.abspath(str(run.dir)) for run in runs]
    twice = next((given[i] for i, w in enumerate(where) if w in where[:i]), None)
    if twice is not None:
        raise errors.PlotError(f"{twice} is given twice; name each run once")
    names = [pathlib.PurePath(w).name if not run.dir.remote else run.dir.name for w, run in zip(where, runs)]
    return [name if names.count(name) == 1 else shown for name, shown in zip(names, given)]


def default_out(names: list[str]) -> str:
    """loss-A-vs-B.png from the runs' labels (characters other than letters, digits, `.`, `_` and `-` as `_`);
    past 100 characters, loss-A-and-N-more.png."""
    safe = [re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "run" for name in names]
    stem = "loss-" + "-vs-".join(safe)
    if len(stem) > 100:
        stem = f"loss-{safe[0][:60]}-and-{len(safe) - 1}-more"
    return stem + ".png"


def check_out(out: str, overwrite: bool) -> tuple[storage.RunDir, str]:
    """(the directory --out is in, its file name): an --out that may be written, or a PlotError. A file there
    is replaced only with --overwrite, and only if it is a PNG (a regular file, not a link)."""
    remote = storage.is_url(out)
    parent, name = out.rstrip("/").rsplit("/", 1) if remote else os.path.split(os.path.abspath(out))
    if not remote and not os.path.isdir(parent):
        raise errors.PlotError(f"--out {out}: the directory {parent} does not exist")
    place = storage.RunDir(parent)
    exists = place.is_file(name) if remote else os.path.lexists(out)
    if not exists:
        return place, name
    if not overwrite:
        raise errors.PlotError(f"{out} already exists; choose another --out or pass --overwrite to replace it")
    if not remote and (os.path.islink(out) or not os.path.isfile(out)):
        raise errors.PlotError(f"--out {out} is not a regular file; --overwrite replaces only a PNG file")
    if not next(place.chunks(name), b"").startswith(PNG_SIGNATURE):
        raise errors.PlotError(f"--out {out} is not a PNG file; --overwrite replaces only a PNG file")
    return place, name


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = [rundir.existing(location) for location in args.runs]
    names = labels(runs, args.runs)
    logged = {}
    for name, run, given in zip(names, runs, args.runs):
        rows = run.logged()
        if not any(math.isfinite(row["loss"]) for row in rows):  # (an empty picture was drawn without a word)
            raise errors.PlotError(f"{run.dir.show(rundir.METRICS)}: every logged loss is NaN or infinite (a run that "
                                   f"diverged from its first step): nothing to draw")
        if any(args.x not in row for row in rows):
            raise errors.PlotError(f"--x {args.x}: {run.dir.show(rundir.METRICS)} has rows without {args.x}; "
                                   f"draw it by {'step' if args.x != 'step' else 'tokens'} (--x)")
        logged[name] = rows
    out = args.out or default_out(names)
    place, file_name = check_out(out, args.overwrite)
    title = "loss: " + " vs ".join(names) if len(names) <= 4 else f"loss of {len(names)} runs"
    place.write_bytes(file_name, plots.compare(logged, args.x, title))
    for name, rows in logged.items():
        evaluations = sum("val_loss" in row for row in rows)
        print(f"{name}: {len(rows)} logged steps to step {rows[-1]['step']}, {evaluations} evaluation"
              + "s" * (evaluations != 1))
    print(f"-> {out} (by {args.x})")
    return 0


def cli(argv=None) -> int:
    """main() with user errors as one `error: ...` line on stderr and exit status 2."""
    return errors.run_cli(main, argv, at_once=True)  # nothing to undo: the picture is written whole or not at all


if __name__ == "__main__":
    sys.exit(cli())
