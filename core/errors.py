"""The user errors, the one-line argument parser, and the one runner every command line goes through.

A mistake a user can make (a path, a config key, a data file, a shape, a checkpoint) raises a
subclass of `UserError` whose str() is one line naming the problem. Every such class is here, one
per concern (DataError for data, ConfigError for the config, RunError for a run directory, ...), so
that any file raises any of them without importing another's module; each module also binds the
ones it raises (`config.ConfigError` is `errors.ConfigError`). `ArgumentParser` makes argparse's
mistakes such an error too, and takes no abbreviation of an option. `run_cli(main)` turns one into
`error: ...` on stderr and the error's exit status (2; 1 for a run that diverged), a Ctrl-C that gets
through into `error: interrupted` and 130, and a reader of the output that has gone (`| head`) into
a quiet end with 141, as a Unix tool killed by SIGPIPE: never a traceback.

    def cli(argv=None) -> int:
        return errors.run_cli(main, argv)

Imports nothing of the project.
"""
from __future__ import annotations

import argparse
import errno
import functools
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


class ServeError(UserError):
    """A user-caused problem starting serve.py (a port in use, a run directory, a size); str(e) is one line."""


class Interrupted(UserError):
    """A Ctrl-C (or SIGTERM, SIGHUP: `signum`) that stopped a command's work part-way, after it put out what it
    had (sample.py's samples so far); str(e) is one line saying where it stopped. Exit status 128 + the
    signal, 130 for a Ctrl-C, as for any stop."""

    exit_status = 130

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.exit_status = 128 + signum


class PlotError(UserError):
    """A user-caused problem with a plot request (plot.py: --out, --x, the runs given); str(e) is one line."""


class ConvertError(UserError):
    """A user-caused problem (paths, steps, unsupported layouts, key mismatches); str(e) is one line."""


class BenchError(UserError):
    """A problem with the benchmark's arguments or inputs; str() is one line naming it."""


class TrainBenchError(UserError):
    """A bad argument of bench.py train (model name, attention on this backend, shape); str() is one line."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a mistake in the arguments (an unknown flag, a missing value) raised as `error`
    (a UserError class): one line, the message and then `hint` (default: where --help is), instead of
    argparse's usage block. Sub-commands' parsers are of this class too. An option is taken only as
    written in full: argparse's abbreviations (`--task` for `--tasks`) would turn a mistyped option of
    one command into another option, found out only when that option's work fails."""

    def __init__(self, *args, hint: str | None = None, error: type[UserError] = UserError, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
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
_program = False  # this process is a command run as a program (not a test calling its cli())


def stop_at_once_while_loading(defer: bool = False) -> None:
    """For a command's first lines, before it imports JAX and the rest: SIGINT, SIGTERM or SIGHUP (Ctrl-C)
    while they load ends it at once with one line and status 128 + N. Nothing is written while
    modules load, and an interrupted import would otherwise end in a traceback or worse (an abort
    inside a native library). run_cli puts the usual handling back before the command's work.

    `defer` (this process is one of several, which must stop together): the first signal is kept
    instead (`pending_signal`), for the command to agree on with the others once they have joined; a
    second one ends the process at once. Called again without `defer` (the command has found that it
    runs alone), a signal kept so far ends the process now.

    It also marks this process as the command's own: once run_cli has said a Ctrl-C's line, the process
    ends at once (end_now), not through the interpreter's finalization."""
    global _deferred, _program

    def stop(signum, frame):
        if signum == signal.SIGHUP:
            detach_from_terminal()
        if _deferred is not None and not _deferred:
            _deferred.append(signum)
            return
        os.write(2, f"error: stopped by {signal.Signals(signum).name} while starting; nothing was done\n".encode())
        os._exit(128 + signum)

    kept = None if defer else pending_signal()
    _deferred, _program = ([] if defer else None), True
    for s in STOP_SIGNALS:
        signal.signal(s, stop)
    if kept is not None:
        stop(kept, None)


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
        interrupted: str = "interrupted", at_once: bool = False, so_far: Callable[[], str] | None = None) -> int:
    """main(argv), with a UserError as one `error: ...` line on stderr and its exit status, a
    KeyboardInterrupt as `error: <interrupted>` and 130 (see `describe`), and standard output whose
    reader has gone (`python sample.py ... | head`) as a quiet 141 (`reader_gone`).

    Run as a program (stop_at_once_while_loading), a Ctrl-C ends the process at once once its line is
    said (end_now), never through the interpreter's finalization: a KeyboardInterrupt can stop JAX in
    the middle of anything (making its backend, lowering, compiling), and finalization would then tear
    down a half-made runtime (a segmentation fault after the line, status 139). `at_once`, for a command
    with nothing to undo (eval.py, sample.py): the Ctrl-C is not even raised, its handler says the line
    and ends the process where it stands. A KeyboardInterrupt can be raised where Python drops it (a
    garbage collector's callback: JAX runs one at every collection), and then the command would run on;
    a handler that ends the process has nothing to drop. (redeliver_interrupt catches the drops of the
    commands that do raise it.)"""
    import threading

    previous_hook = ours = sys.unraisablehook
    try:
        # the defaults, after stop_at_once_while_loading (unless it keeps signals for the command to agree on)
        if threading.current_thread() is threading.main_thread() and _deferred is None:
            signal.signal(signal.SIGINT, functools.partial(stop_now, f"error: {interrupted}", so_far)
                          if _program and at_once else signal.default_int_handler)
            for other in (signal.SIGTERM, signal.SIGHUP):  # (the loading's line, "while starting", is wrong now)
                signal.signal(other, functools.partial(stop_now, f"error: stopped by {signal.Signals(other).name}",
                                                       so_far) if _program and at_once else signal.SIG_DFL)
        ours = sys.unraisablehook = functools.partial(redeliver_interrupt, previous_hook)
        status = main(argv)
        sys.stdout.flush()  # a reader that has gone is found here, not at the interpreter's exit
        if _program:  # done, its output out: a late Ctrl-C changes nothing
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return status
    except (UserError, KeyboardInterrupt, OSError, RuntimeError) as e:
        if isinstance(e, BrokenPipeError) and stdout_gone():
            return reader_gone()
        said = describe(e, interrupted)
        if said is None:
            raise
        if _program and isinstance(e, KeyboardInterrupt):
            end_now(*said)
        print(said[0], file=sys.stderr)
        return said[1]
    finally:  # (a hook the command put in place of ours stays: e.g. checkpoints', for what ends after it)
        if sys.unraisablehook is ours:
            sys.unraisablehook = previous_hook


def stop_now(line: str, so_far: Callable[[], str] | None, signum: int, frame) -> None:
    """A SIGINT, SIGTERM or SIGHUP handler (run_cli's `at_once`): `line` on stderr, with what `so_far` says
    the command had done (e.g. which results it saved), and status 128 + N, at once (after a SIGHUP,
    output meant for the terminal that is gone goes nowhere)."""
    if signum == signal.SIGHUP:
        detach_from_terminal()
    end_now(line + (so_far() if so_far is not None else ""), 128 + signum)


def redeliver_interrupt(previous_hook, unraisable) -> None:
    """sys.unraisablehook while a command runs: a Ctrl-C whose KeyboardInterrupt was raised where Python
    cannot pass it on (a garbage collector's callback, such as JAX's, a __del__, a weak reference's
    callback), which Python would print as ignored and drop, is delivered again a moment later, from
    another thread, to be raised in the command's own code (not in this hook, where it would be dropped
    too); anything else goes to the previous hook."""
    import threading

    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        threading.Timer(REDELIVER_AFTER, os.kill, (os.getpid(), signal.SIGINT)).start()
    else:
        previous_hook(unraisable)


REDELIVER_AFTER = 0.01  # seconds: out of the callback that dropped the KeyboardInterrupt


SIGPIPE_STATUS = 128 + 13  # what a shell reports for a tool that SIGPIPE killed (`yes | head`)


def stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (poll says POLLERR on its end)."""
    import select

    try:
        poller = select.poll()
        poller.register(1, select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no such descriptor, or no poll on this system
        return False


def reader_gone() -> int:
    """The end of a command whose output's reader has gone (`| head -c 600`): nothing on stderr, standard
    output pointed at /dev/null (what is still buffered goes nowhere, not into an error at exit), and
    141, the status a Unix tool killed by SIGPIPE gives (`set -o pipefail` sees it)."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    return SIGPIPE_STATUS


def end_now(line: str, status: int) -> None:
    """Say `line` on stderr and end the process with `status` at once, with what standard output holds
    flushed but without the interpreter's finalization (nor atexit's functions): for a stop that may have
    come in the middle of JAX's work. A further Ctrl-C (or SIGTERM, SIGHUP) changes nothing."""
    import contextlib

    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    for stream in (sys.stdout, sys.stderr):
        # a reader that has gone, a closed stream, a stream the interrupted code was writing to
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            stream.flush()
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode(errors="replace"))
    os._exit(status)


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
