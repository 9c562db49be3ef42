"""A run's JSON Lines log (metrics.jsonl): read back (`json_lines`), and continued by one writer (`JsonLines`).

Locally each row is appended to the file and flushed at once; in an object store, which has no appends,
the whole file is uploaded, replacing only the generation this process wrote or read last, so that a
writer that lost the run cannot put its rows back over the new holder's. A last line a kill cut off
during its write is told apart from a damaged line before it, which is one StorageError naming the file.

Built on storage.py's RunDir and Versions; imports nothing of the project but storage.py and errors.py.
"""
from __future__ import annotations

import json
import pathlib
import time

from core.errors import StorageError
from core.storage import Conflict, RunDir, Versions

FLUSH_SECONDS = 30.0  # a remote metrics.jsonl is uploaded at least this often while training logs


def json_lines(text: str, shown: str) -> tuple[list[tuple[object, str]], str | None]:
    """([(row, its line as written)], the last line if a kill cut it off during its write, else None) of a
    JSON Lines log's text; a line before the last that is not JSON is a StorageError naming the file `shown`."""
    lines = [line for line in text.splitlines() if line.strip()]
    parsed, torn = [], None
    for number, line in enumerate(lines, 1):
        try:
            parsed.append((json.loads(line), line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise StorageError(f"{shown}: line {number} is not JSON; repair or remove it") from None
            torn = line
    return parsed, torn


class JsonLines:
    """A run's JSON Lines log (metrics.jsonl), restarted with the rows `keep` accepts.

    Locally each row is appended and flushed at once. An object store has no appends: the rows are
    kept in memory and the whole file is uploaded by flush() (train.py calls it at each evaluation and
    checkpoint), at least every FLUSH_SECONDS while rows come in, and by close(). Where the store has
    generations (Google Cloud Storage) each upload replaces only the generation this process wrote or read
    last (see _upload).
    """

    def __init__(self, run: RunDir, name: str, keep=lambda row: True):
        self.run, self.name = run, name
        self.generation = None  # in an object store, the generation of the file this process wrote or read last
        for attempt in range(3):
            try:
                self._start(keep)
                break
            except Conflict:  # replaced between our read and our write (a writer that lost the run): read again
                if attempt == 2:
                    self._replaced()
        self.file = None if run.remote else open(pathlib.Path(run.root) / name, "a")

    def _start(self, keep) -> None:
        """Read the file (with its generation, in an object store), keep the rows `keep` accepts, write them."""
        run, name = self.run, self.name
        if run.remote:
            self.generation, raw = Versions(run).versioned(name)
            text = raw.decode()
        else:
            text = run.read_text(name) if run.is_file(name) else ""
        parsed, self.torn = json_lines(text, run.show(name))  # torn: said by the caller
        kept = [(row, line) for row, line in parsed if keep(row)]
        self.rows = [row for row, _ in kept]  # the rows kept, in order
        self.lines = [line + "\n" for _, line in kept]
        self._upload()

    def append(self, row: dict) -> None:
        line = json.dumps(row) + "\n"
        if self.file is not None:
            self.file.write(line)
            self.file.flush()
            return
        self.lines.append(line)
        if time.monotonic() - self.uploaded > FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if self.file is None:
            try:
                self._upload()
            except Conflict:
                self._replaced()

    def _upload(self) -> None:
        """The whole file: locally replaced; in an object store only while it is the generation this process
        wrote (or read) last, so that a writer paused between the run's fence and its upload (past its lease,
        the run taken over meanwhile) cannot put its rows back over the new holder's: Conflict then. A write
        of ours whose answer was lost (the client retried it, and the retry found our own write there) is
        no conflict: the file holds what we wrote."""
        content = "".join(self.lines).encode()
        if not self.run.remote:
            self.run.write_bytes(self.name, content)
            return
        self.run.check_fence()
        versions = Versions(self.run)
        try:
            self.generation = versions.write_if(self.name, content, self.generation)
        except Conflict:
            generation, there = versions.versioned(self.name)
            if there != content:
                raise
            self.generation = generation
        self.uploaded = time.monotonic()

    def _replaced(self):
        """Another process replaced the file: stop with the lease's own line when it is lost (which it then
        is, for a run's log), else with this one."""
        self.run.check_fence()
        raise StorageError(f"{self.run.show(self.name)} was replaced by another process meanwhile: this "
                           f"process no longer writes the run") from None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        else:
            self.flush()
