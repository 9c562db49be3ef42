"""The user-error base class and the one runner every command line goes through.

A mistake a user can make (a path, a config key, a data file, a shape, a checkpoint) raises a
subclass of `UserError` whose str() is one line naming the problem: corpus.DataError,
config.ConfigError, storage.StorageError, sharding.ShardingError, rundir.RunError, and each tool's
own. `run_cli(main)` turns one into `error: ...` on stderr and the error's exit status (2; 1 for a run
that diverged), and a Ctrl-C that gets through into `error: interrupted` and 130: never a traceback.

    def cli(argv=None) -> int:
        return errors.run_cli(main, argv)

Imports nothing of the project.
"""
from __future__ import annotations

import sys
from typing import Callable, Sequence


class UserError(Exception):
    """A problem the user can fix; str(e) is one line. `exit_status` is the command's exit status."""

    exit_status = 2


def run_cli(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None, *,
        interrupted: str = "interrupted") -> int:
    """main(argv), with a UserError as one `error: ...` line on stderr and its exit status, and a
    KeyboardInterrupt as `error: <interrupted>` and 130."""
    try:
        return main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        print(f"error: {interrupted}", file=sys.stderr)
        return 130
