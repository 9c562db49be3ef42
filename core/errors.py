"""The user errors, the one-line argument parser, and the one runner every command line goes through.

A mistake a user can make (a path, a config key, a data file, a shape, a checkpoint) raises a
subclass of `UserError` whose str() is one line naming the problem. Every such class is here, one
per concern (DataError for data, ConfigError for the config, RunError for a run directory, ...), so
that any file raises any of them without importing another's module; each module also binds the
ones it raises (`config.ConfigError` is `errors.ConfigError`). `ArgumentParser` makes argparse's
mistakes such an error too. `run_cli(main)` turns one into `error: ...` on stderr and the error's
exit status (2; 1 for a run that diverged), and a Ctrl-C that gets through into
`error: interrupted` and 130: never a traceback.

    def cli(argv=None) -> int:
        return errors.run_cli(main, argv)

Imports nothing of the project.
"""
from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
from typing import Callable, Sequence


class UserError(Exception):
    """A problem the user can fix; str(e) is one line. `exit_status` is the command's exit status."""

    exit_status = 2


class DataError(UserError):
    """A problem with data the user can fix (a path, a file, a setting); str() is one line naming it."""


class MissingFile(DataError):
    """A file of a data directory that is not there (shards.Source names it); str() is one line."""


class ConfigError(UserError):
    """A user-caused configuration problem; str(e) is one line."""


class StorageError(UserError):
    """A run directory's storage cannot be reached (no filesystem package, no access); str(e) is one line."""


class ShardingError(UserError):
    """A mesh or sharding the configuration asks for cannot be built; str(e) is one line."""


class RunError(UserError):
    """A user-caused problem with a run directory or its checkpoints; str(e) is one line."""


class Diverged(UserError):
    """The loss or the parameters stopped being finite: exit status 1, as a failed run, not bad input."""

    exit_status = 1


class PlanError(UserError):
    """A target device or mesh the plan cannot take; str(e) is one line."""


class EvalError(UserError):
    """A user-caused problem with an evaluation request; str(e) is one line."""


class SampleError(UserError):
    """A user-caused problem with a sampling request; str(e) is one line."""


class ConvertError(UserError):
    """A user-caused problem (paths, steps, unsupported layouts, key mismatches); str(e) is one line."""


class BenchError(UserError):
    """A problem with the benchmark's arguments or inputs; str() is one line naming it."""


class TrainBenchError(UserError):
    """A bad argument of bench.py train (model name, attention on this backend, shape); str() is one line."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a mistake in the arguments (an unknown flag, a missing value) raised as `error`
    (a UserError class): one line, the message and then `hint` (default: where --help is), instead of
    argparse's usage block. Sub-commands' parsers are of this class too."""

    def __init__(self, *args, hint: str | None = None, error: type[UserError] = UserError, **kwargs):
        super().__init__(*args, **kwargs)
        self.hint, self.error_class = hint, error

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", lambda **kw: type(self)(error=self.error_class, **kw))
        return super().add_subparsers(**kwargs)

    def error(self, message):
        raise self.error_class(f"{message} ({self.hint or f'see python {self.prog} --help'})")


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C, a kill or a preemption, a closed terminal


def detach_from_terminal() -> None:
    """After SIGHUP (the terminal was closed, an ssh session dropped): standard output and error that went
    to that terminal go to /dev/null from now on, so that the work still to do (a checkpoint to save)
    never fails on a write to a terminal that is gone. Output to a file or a pipe stays."""
    import stat

    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        try:
            terminal = stat.S_ISCHR(os.fstat(fd).st_mode)  # (isatty says no once the terminal has hung up)
        except OSError:  # already unusable
            terminal = True
        if terminal:
            os.dup2(null, fd)
    os.close(null)
PYTHON = (3, 11)  # the oldest Python the project and its pinned dependencies run on

if sys.version_info < PYTHON:  # every entry point imports this file first: one line, not a SyntaxError later
    sys.exit(f"error: Python {'.'.join(map(str, PYTHON))} or newer is needed, this is {sys.version.split()[0]}; "
             f"make the virtual environment with python3.11 -m venv .venv (or newer)")


def missing_package_line(e: ModuleNotFoundError) -> str:
    """One line for a package this Python lacks: most often a command run outside the README's environment."""
    in_venv = sys.prefix != sys.base_prefix
    where = ("this virtual environment lacks it: pip install -r requirements.txt" if in_venv else
             "run it in the environment the README makes (. .venv/bin/activate), or install the packages there "
             "(pip install -r requirements.txt)")
    return f"error: no module named {e.name!r} in {sys.executable}: {where}"


def _missing_package_hook(kind, value, traceback):
    """sys.excepthook: a ModuleNotFoundError that reaches the top (an import at start-up) is one line."""
    if isinstance(value, ModuleNotFoundError) and value.name and value.name.split(".")[0] not in _PROJECT:
        print(missing_package_line(value), file=sys.stderr)
        sys.exit(2)
    _previous_hook(kind, value, traceback)


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: core/ is one of its folders
_PROJECT = {os.path.splitext(name)[0] for name in os.listdir(_ROOT)  # its modules and packages:
            if name.endswith(".py") or os.path.isfile(os.path.join(_ROOT, name, "__init__.py"))}
# a missing file of the project is a real bug: its traceback stays
_previous_hook = sys.excepthook
if __name__ != "__main__":
    sys.excepthook = _missing_package_hook


_deferred: list[int] | None = None  # while loading with several processes: the signals that arrived


def stop_at_once_while_loading(defer: bool = False) -> None:
    """For a command's first lines, before it imports JAX and the rest: SIGINT, SIGTERM or SIGHUP (Ctrl-C)
    while they load ends it at once with one line and status 128 + N. Nothing is written while
    modules load, and an interrupted import would otherwise end in a traceback or worse (an abort
    inside a native library). run_cli puts the usual handling back before the command's work.

    `defer` (this process is one of several, which must stop together): the first signal is kept
    instead (`pending_signal`), for the command to agree on with the others once they have joined; a
    second one ends the process at once."""
    global _deferred

    def stop(signum, frame):
        if signum == signal.SIGHUP:
            detach_from_terminal()
        if _deferred is not None and not _deferred:
            _deferred.append(signum)
            return
        os.write(2, f"error: stopped by {signal.Signals(signum).name} while starting; nothing was done\n".encode())
        os._exit(128 + signum)

    _deferred = [] if defer else None
    for s in STOP_SIGNALS:
        signal.signal(s, stop)


def pending_signal() -> int | None:
    """The signal kept while loading (see stop_at_once_while_loading's `defer`), taken: None when none came."""
    global _deferred
    taken = _deferred[0] if _deferred else None
    _deferred = None
    return taken


def parse_before_loading(parse_args: Callable[[Sequence[str]], object]) -> None:
    """For a command's first lines, once its parse_args is defined and before it imports JAX: answer
    --help at once and refuse a mistaken argument in one line, without loading anything heavy. main()
    parses the same arguments again (cheap) for its work."""
    try:
        parse_args(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_status)


def run_cli(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None, *,
        interrupted: str = "interrupted") -> int:
    """main(argv), with a UserError as one `error: ...` line on stderr and its exit status, and a
    KeyboardInterrupt as `error: <interrupted>` and 130 (see `describe`)."""
    import threading

    # the defaults, after stop_at_once_while_loading (unless it keeps signals for the command to agree on)
    if threading.current_thread() is threading.main_thread() and _deferred is None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        return main(argv)
    except (UserError, KeyboardInterrupt, OSError, RuntimeError) as e:
        said = describe(e, interrupted)
        if said is None:
            raise
        print(said[0], file=sys.stderr)
        return said[1]


def describe(e: BaseException, interrupted: str = "interrupted") -> tuple[str, int] | None:
    """(the one `error: ...` line, the exit status) for an error a user can cause: a UserError, a Ctrl-C
    that got through (130), a path the system refused (2), a symbolic link pointing back into itself (2);
    None for anything else (a bug, whose traceback is kept)."""
    if isinstance(e, UserError):
        return f"error: {e}", e.exit_status
    if isinstance(e, KeyboardInterrupt):
        return f"error: {interrupted}", 130
    if isinstance(e, OSError) and e.errno in PATH_ERRNOS:  # a path the user gave, wherever it surfaced
        return f"error: {path_problem(e)}", UserError.exit_status
    if isinstance(e, RuntimeError) and str(e).startswith("Symlink loop"):  # pathlib's resolve()
        return f"error: {str(e).splitlines()[0]}: a symbolic link on the path points back into itself", \
            UserError.exit_status
    return None


PATH_ERRNOS = {getattr(errno, name) for name in ("ENOENT", "ENOTDIR", "EISDIR", "ENAMETOOLONG", "ELOOP", "EACCES",
                                                 "EPERM", "EROFS", "ENOSPC", "EDQUOT", "EEXIST", "EXDEV")
               if hasattr(errno, name)}


def path_problem(e: OSError) -> str:
    """One line for an OSError about a path: the path(s) and what the system said."""
    where = " -> ".join(repr(str(p)) for p in (e.filename, e.filename2) if p is not None)
    what = e.strerror or str(e)
    hint = {errno.ENAMETOOLONG: " (a name on the path is longer than the filesystem allows, 255 bytes on most)",
            errno.ELOOP: " (a symbolic link on the path points back into itself)"}.get(e.errno, "")
    return f"{where + ': ' if where else ''}{what}{hint}"
