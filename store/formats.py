"""What this code writes and what it reads: the format numbers of a run directory and of a checkpoint.

A training run outlives a version of this toolkit: it is stopped, the toolkit upgraded (`git pull`),
and the run resumed, evaluated, sampled, exported. The promise: every format this project has ever
written stays readable (age is not damage), and a format newer than the code is refused in one line
naming the version that reads it (a downgrade under a run).

    format  written from  what changed
    1       2026-11-22    orbax checkpoints of {params, opt_state, step, rng}, no fingerprints
    2       2026-11-24    + every array's fingerprint in the checkpoint's metadata (and the tokens trained)
    3       2026-11-27    + the format itself, in RUN/format.json and in every checkpoint's metadata, and
                          a fingerprint of that metadata (tokens trained included)

A run directory written before format 3 has no RUN/format.json; a checkpoint written before it has no
`format` in its metadata, and is told by what it holds (fingerprints.checkpoint_format). A checkpoint of
format 1 cannot be verified (it has no fingerprints): it is read with one line saying so. One of format
2 or later must carry its fingerprints: missing or unreadable ones are damage, refused. RUN/format.json also
records the step after which every checkpoint of the run records its format (`checkpoints_after`, from
2026-12-02 on: the step a run started at, or an older run was first resumed at): a checkpoint after it
whose metadata holds nothing, like format 1's, was emptied (store/checkpoints.py, Checkpoints.format_of).

Imports nothing of the project; knows nothing of models or storage.
"""
from __future__ import annotations

FORMAT = 3  # what this code writes
FIRST_RECORDED = 3  # formats 1 and 2 recorded no number: they are told by what a checkpoint holds
SINCE = {1: "2026-11-22", 2: "2026-11-24", 3: "2026-11-27"}  # the first version that wrote each format
FILE = "format.json"  # RUN/format.json: {"format": N, "since": date, "checkpoints_after": step}


def record() -> dict:
    """What a run directory (RUN/format.json) and a checkpoint's metadata record of the format they are
    written in: the number and the first version of the toolkit that wrote it (which a reader too old for
    it names)."""
    return {"format": FORMAT, "since": SINCE[FORMAT]}


def run_record(step: int, recorded: dict | None) -> dict:
    """RUN/format.json as a writer that starts (or resumes) the run at `step` writes it: this code's record,
    and the step after which every checkpoint of the run records its format (what `recorded`, the file as it
    was, says, when it says an earlier one): a checkpoint saved after it whose metadata holds nothing was
    emptied, not written before formats were recorded."""
    after = checkpoints_after(recorded or {})
    return {**record(), "checkpoints_after": step if after is None else min(after, step)}


def checkpoints_after(recorded: dict) -> int | None:
    """The step RUN/format.json's record says the run's checkpoints record their format after (None: it says
    none, as a record written before 2026-12-02 does, or not a step)."""
    after = recorded.get("checkpoints_after")
    return after if isinstance(after, int) and not isinstance(after, bool) and after >= 0 else None


def too_new(what: str, recorded: dict) -> str | None:
    """Why `what` (a run directory, a checkpoint), recording `recorded` ({format, since}), cannot be read by
    this code, in one line; None when it can. A format that is not a positive integer is None here too:
    the caller decides whether that is damage."""
    number = recorded.get("format")
    if not isinstance(number, int) or isinstance(number, bool) or number <= FORMAT:
        return None
    since = recorded.get("since")
    if isinstance(since, str) and since <= SINCE[FORMAT]:  # (ISO dates compare as strings)
        return (f"{what} says it is in format {number}, first written on {since}, but no version wrote a format "
                f"after {FORMAT} by then (format {FORMAT} is from {SINCE[FORMAT]}): its record was altered or damaged")
    version = f"the toolkit's versions from {since} on" if isinstance(since, str) else "a newer toolkit"
    return (f"{what} is in format {number}, written by {version}; this code reads formats 1-{FORMAT} (written up "
            f"to {SINCE[FORMAT]}): upgrade (git pull, then pip install -r requirements.txt) to "
            + (f"a version of {since} or later" if isinstance(since, str) else "the version that wrote it"))
