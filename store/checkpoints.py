"""A run's checkpoints: RUN/checkpoints/, written by orbax, read through `Checkpoints`, written through `Saver`.

    RUN/checkpoints/<step>/     orbax checkpoints of the state {params, opt_state, step, rng}, each with its
                                format (formats.py), a fingerprint of every array and the tokens trained so
                                far in its metadata, and a fingerprint of that metadata; the fingerprints
                                are checked on every restore (a checkpoint from before them, format 1, is
                                read with one line saying it cannot be verified)
    RUN/checkpoints/.deleting/  old checkpoints being deleted: renamed here first, so that a kill during
                                a deletion never leaves half a checkpoint under its step's name
    RUN/checkpoints-damaged/    checkpoints a resume could not restore, moved aside (never deleted): <step>/,
                                or <step>.1/, ... for a step damaged again

train.py saves and restores through a `Saver` (asynchronously, rotating old ones out), an import saves
its parameters through one (synchronously), and every reader (weights.Weights.load_params, hence
init_from, eval, sample and export) loads through `Checkpoints`; a run's one owner of them,
`RunCheckpoints` (rundir.Run's `checkpoints`), opens either. Whether a
checkpoint reads as it was saved (fingerprints, formats) is fingerprints.py's. A save that fails (a full
disk, no access to a bucket), a checkpoint that cannot be read or that does not fit the model: a
RunError, one line in the user's terms, never orbax's or tensorstore's tracebacks.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

from core import storage
from core.errors import RunError
from store import fingerprints as fingerprints_lib
from store import formats

CHECKPOINTS = "checkpoints"
DAMAGED = "checkpoints-damaged"
DELETING = ".deleting"  # inside RUN/checkpoints
SAID_UNVERIFIED: set = set()  # (directory, step) of the format 1 checkpoints a reader has said so of
STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax's file of a checkpoint's own metadata, ours among it


class RunCheckpoints:
    """RUN/checkpoints of one run directory, the one owner of its reading and writing: `read()` opens them to
    read (a Checkpoints), `write(keep, async_save)` to save and restore, for the holder of the run's lock
    (a Saver). Each is closed by its user (`with`)."""

    def __init__(self, directory: storage.RunDir):
        self.dir = directory

    def read(self) -> Checkpoints:
        return Checkpoints(self.dir)

    def write(self, keep: int | None = None, async_save: bool = False) -> Saver:
        return Saver(self.dir, keep, async_save)

    def steps(self) -> list[int]:
        """The steps of the checkpoints there are."""
        with self.read() as saved:
            return saved.steps()

    def check_saved(self, step: int, abstract_state) -> None:
        """That checkpoint `step`, just saved and its save waited for, is there as a resume will find it: a
        complete step (orbax's rename, or a bucket's commit marker), its metadata read back with its
        format and its own fingerprint, its description of the arrays the tree of `abstract_state`. A
        RunError saying what is wrong otherwise, so that no line ever names a checkpoint that is not
        there. The arrays' bytes are not read back here (a whole model's worth): a restore checks each
        against its fingerprint."""
        with self.read() as saved:
            steps = saved.steps()
            try:
                if step not in steps:
                    raise ValueError("it is not among the complete checkpoints there ("
                                     + (", ".join(map(str, steps)) or "none") + ")")
                custom = saved.custom_metadata(step)
                number = saved.format_of(step, custom)
                problem = fingerprints_lib.metadata_problem(custom, number)
                tree = saved_tree(saved.manager(), step)
                problem = problem or ("its description of the arrays (_METADATA) is missing or unreadable"
                                      if tree is None else fingerprints_lib.tree_mismatch(tree, abstract_state))
                if problem:
                    raise ValueError(problem)
            except Exception as e:
                logging.getLogger("asyncio").setLevel(logging.CRITICAL)
                raise RunError(f"checkpoint {step} in {saved.dir} was saved but does not read back "
                               f"({checkpoint_problem(e) if not isinstance(e, ValueError) else e}); "
                               + (f"the newest complete checkpoint before it is {max(s for s in steps if s < step)}: "
                                  "continue from it with --resume" if any(s < step for s in steps) else
                                  "there is no other checkpoint: --resume starts the run again from step 0")) \
                    from None


class Checkpoints:
    """The checkpoints of one run directory (`run`, a storage.RunDir), read, and the orbax
    CheckpointManager behind them, opened at the first read and closed by close() (or `with`). Saving,
    restoring (which moves damaged checkpoints aside) and rotating are a Saver's."""

    def __init__(self, run: storage.RunDir):
        self.run, self.dir = run, run.checkpoint_dir()  # a resolved local path, or the URL (orbax opens gs://)
        self.mngr = None

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def manager(self):
        """The orbax CheckpointManager, opened on first use."""
        import orbax.checkpoint as ocp

        if self.mngr is not None:
            return self.mngr
        if str(self.dir).startswith("gs://"):
            tensorstore_authenticated(str(self.dir)[len("gs://"):].split("/")[0])
        if getattr(sys.unraisablehook, "func", None) is not drop_closed_loop_errors:  # once, before the one there:
            sys.unraisablehook = functools.partial(drop_closed_loop_errors, then=sys.unraisablehook)  # (run_cli's)
        absl = logging.getLogger("absl")  # orbax's: what it says of a damaged checkpoint, restore and load say
        absl.setLevel(logging.ERROR)  # in the user's terms ("Metadata file does not exist" was a WARNING line)
        if SAVE_ERRORS not in absl.filters:  # orbax's own reports of a failed save or read: kept for our one line
            absl.addFilter(SAVE_ERRORS)
        self.mngr = self.opened(ocp)
        return self.mngr

    def opened(self, ocp):
        """A reader's manager: its item's handler reads the checkpoint's description of its arrays."""
        return ocp.CheckpointManager(self.dir, item_handlers=ocp.StandardCheckpointHandler())

    def close(self) -> None:
        """Close the manager (if one was opened)."""
        if self.mngr is not None:
            self.mngr.close()
            self.mngr = None

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first ([] when there are none), as orbax counts
        them: locally a step's directory appears only once complete; in a bucket a step's objects make
        a checkpoint only once its save has written the commit marker (commit_success.txt), last."""
        import orbax.checkpoint as ocp

        forget_listings(self.dir)  # tensorstore writes the arrays past etils' listing cache
        return sorted(ocp.path.step.checkpoint_steps(self.dir))

    def tokens(self, step: int) -> int | None:
        """The tokens trained up to checkpoint `step`, as saved with it: fingerprinted with the rest of its
        metadata from format 3 on (restore and load check it); None for a checkpoint without them (format 1)
        or with a value that cannot be a count of tokens (an unverifiable format 2 one): the caller counts."""
        tokens = self.custom_metadata(step).get(fingerprints_lib.TOKENS)
        return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= step else None

    def row(self, step: int) -> dict | None:
        """The metrics row checkpoint `step` was saved with (None: saved before rows were kept, or unreadable)."""
        try:
            row = self.custom_metadata(step).get(fingerprints_lib.ROW)
        except (OSError, ValueError):
            return None
        return row if isinstance(row, dict) and row.get("step") == step else None

    def custom_metadata(self, step: int) -> dict:
        """Checkpoint `step`'s own metadata as this project writes it: the custom part of its
        _CHECKPOINT_METADATA, which orbax writes into every checkpoint (a format 1 one's is empty). A file
        that is missing, unreadable or without that part is damage: a ValueError saying so (orbax's own
        reader would give an empty one, which would pass for format 1, unverified)."""
        from etils import epath  # orbax's paths: a local directory or a bucket alike

        try:
            raw = json.loads((epath.Path(self.dir) / str(step) / STEP_METADATA).read_bytes())
        except Exception as e:  # missing, unreadable, not JSON
            raise ValueError(f"its metadata ({STEP_METADATA}) is missing or unreadable ({storage.one_line(e)[:120]})") \
                from None
        custom = raw.get("custom_metadata") if isinstance(raw, dict) else None
        if not isinstance(custom, dict):
            raise ValueError(f"its metadata ({STEP_METADATA}) has no custom metadata, as every checkpoint has")
        return custom

    def format_of(self, step: int, custom: dict) -> int:
        """The format checkpoint `step` was written in, from its metadata `custom` (fingerprints.checkpoint_format),
        the run's record checked where the metadata holds nothing of this project's, as only a format 1
        checkpoint's does: a checkpoint saved after one that carries fingerprints, or after the step from which
        RUN/format.json says the run's checkpoints record their format, was not written so; its metadata was
        emptied (a ValueError saying so)."""
        number = fingerprints_lib.checkpoint_format(custom)
        if number != 1:
            return number
        emptied = ("its metadata (_CHECKPOINT_METADATA) holds nothing of this project's, as only a checkpoint "
                   f"from before {formats.SINCE[2]} (format 1) does, but ")
        try:
            after = formats.checkpoints_after(self.run.json_object(formats.FILE) or {})
        except Exception:  # a damaged record: the checkpoints before this one still tell
            after = None
        if after is not None and step > after:
            raise ValueError(emptied + f"the run's {formats.FILE} says every checkpoint after step {after} records its "
                             "format: the metadata was emptied or damaged")
        for earlier in sorted((s for s in self.steps() if s < step), reverse=True):
            try:
                other = fingerprints_lib.checkpoint_format(self.custom_metadata(earlier))
            except ValueError:
                continue
            if other > 1:
                raise ValueError(emptied + f"checkpoint {earlier} before it carries fingerprints (format {other}): the "
                                 "metadata was emptied or damaged")
            break  # a format 1 checkpoint before it: a run from before fingerprints
        return number

    def load(self, step: int | None = None) -> tuple[dict, int]:
        """(state, step) of a checkpoint, the last one by default, as saved (dict keys as strings), its
        fingerprints checked: for readers, which have no abstract state to restore into."""
        import orbax.checkpoint as ocp

        steps = self.steps()
        if not steps:
            raise RunError(f"no checkpoint in {self.dir}")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise RunError(f"no checkpoint for step {step} in {self.dir}; saved steps: {', '.join(map(str, steps))}")
        mngr = self.manager()
        try:
            custom = self.custom_metadata(step)
        except ValueError as e:
            raise RunError(f"checkpoint {step} in {self.dir} cannot be read: {e}") from None
        newer = formats.too_new(f"checkpoint {step} in {self.dir}", custom)
        if newer:
            raise RunError(newer)
        try:
            number = self.format_of(step, custom)
        except ValueError as e:
            raise RunError(f"checkpoint {step} in {self.dir} is corrupt: {e}") from None
        try:
            state = mngr.restore(step, args=ocp.args.StandardRestore(host_arrays(mngr, step)))
            corrupt = (fingerprints_lib.fingerprint_problem(custom, number, state)
                       or fingerprints_lib.step_problem(state, step))
        except Exception as e:  # a damaged checkpoint
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # "Future exception was never retrieved"
            raise RunError(f"checkpoint {step} in {self.dir} cannot be read: {checkpoint_problem(e)}") from None
        if corrupt:
            raise RunError(f"checkpoint {step} in {self.dir} is corrupt: {corrupt}")
        if number == 1 and (self.dir, step) not in SAID_UNVERIFIED:
            SAID_UNVERIFIED.add((self.dir, step))
            print(fingerprints_lib.unverified(step, self.dir), file=sys.stderr, flush=True)
        return state, step

    def saved_fingerprints(self, step: int) -> dict[str, str]:
        """The array fingerprints saved with checkpoint `step`, by leaf name ({} if it has none): what `load`
        checks the arrays it reads against, so after a load they describe what it returned."""
        saved = self.custom_metadata(step).get(fingerprints_lib.FINGERPRINTS)
        return {k: v for k, v in saved.items() if k != fingerprints_lib.METADATA} if isinstance(saved, dict) else {}

    def damaged_dir(self) -> str:
        """RUN/checkpoints-damaged, as a local path or URL (where restore moves what it cannot read)."""
        if self.run.remote:
            return f"{self.run.location}/{DAMAGED}"
        return str(pathlib.Path(self.dir).parent / DAMAGED)


class Saver(Checkpoints):
    """The checkpoints of a run directory written, by the holder of the run's lock (train.py, an import):
    `keep` checkpoints kept, saved asynchronously if `async_save`; what killed saves and deletions left is
    cleared on opening; on close the last save is waited for (a RunError if it failed) and what rotation
    retired is deleted. A resume restores through it (damaged checkpoints are moved aside)."""

    def __init__(self, run: storage.RunDir, keep: int | None = None, async_save: bool = False):
        super().__init__(run)
        if not run.remote:
            own = pathlib.Path(run.location).absolute() / "checkpoints"
            if own.is_symlink():  # a resume would write, rotate and delete inside whatever it points to
                raise RunError(f"{own} is a symbolic link (to {os.readlink(own)}); a run's checkpoints must be "
                               f"its own directory: move the link away and the checkpoints into its place")
        self.keep, self.async_save = keep, async_save
        self.pending = None  # the step of the save in flight

    def __exit__(self, *exc) -> None:
        try:
            self.run.check_fence()
        except RunError:  # this process lost the run (paused past its lease): a save it still had in
            # flight is abandoned, and its writes, failing as the new holder replaces what they wrote,
            # are not this process's to report ("Future exception was never retrieved", each a traceback)
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        self.close()

    def opened(self, ocp):
        """A writer's manager, once what killed saves and deletions left is cleared: it keeps `keep`
        checkpoints, saves asynchronously if so opened, and commits a save in a bucket behind the fence."""
        self.purge_deleted(unfinished=True)
        _small_arrays_written_whole()
        return ocp.CheckpointManager(
            self.dir,
            options=ocp.CheckpointManagerOptions(enable_async_checkpointing=self.async_save,
                                                 todelete_subdir=DELETING,  # object stores delete in place
                                                 # (its replacement, atomicity_options, takes no class of ours:
                                                 # the fence needs this one)
                                                 temporary_path_class=fenced_commit(self.run.check_fence)
                                                 if self.run.remote else None, **keeping(ocp, self.keep)),
            item_handlers=ocp.StandardCheckpointHandler(),  # so that a checkpoint's tree can be read before restoring
        )

    def close(self) -> None:
        """Wait for the save in flight (a RunError if it failed), close the manager, then delete what
        rotation retired."""
        if self.mngr is None:
            return
        try:
            self.wait()
        finally:
            super().close()
        self.purge_deleted()

    def save(self, step: int, state, tokens: int | None = None, row: dict | None = None) -> None:
        """Save `state` as checkpoint `step` (asynchronously if so opened), with the fingerprint of every
        array, the `tokens` trained so far and the step's metrics `row` in its metadata; then finish deleting
        the checkpoints that rotation retired. The save before it must have completed: a RunError if it did not."""
        import orbax.checkpoint as ocp

        mngr = self.manager()
        self.run.check_fence()  # a holder that lost the run's lease writes no checkpoint, nor waits for the
        self.wait()  # one in flight (never committed now; with several processes its barriers wait for ever)
        self.pending = step
        SAVE_ERRORS.messages.clear()  # what is reported from here on is this save's
        try:
            mngr.save(step, args=ocp.args.StandardSave(state), force=True,
                      custom_metadata=fingerprints_lib.metadata(state, tokens, row))
        except Exception as e:  # a synchronous save that failed
            SAVE_ERRORS.messages.append(str(e))
            self.wait()
        self.purge_deleted()

    def wait(self) -> None:
        """Wait for the save in flight; a RunError if it did not complete (a full disk, no access): orbax
        only logs that, and a run going on would leave the user believing in a checkpoint that is not there."""
        step, self.pending = self.pending, None
        if self.mngr is None:
            return
        try:
            self.mngr.wait_until_finished()
        except Exception as e:
            SAVE_ERRORS.messages.append(str(e))
        if step is None or step in self.steps():
            return
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # "Future exception was never retrieved"
        try:
            self.mngr.close()
        except Exception:
            pass
        for _ in range(40):  # the failed save's partial files, once its last writes (failing too) have ended
            self.purge_deleted(unfinished=True)
            time.sleep(0.05)
            if self.run.remote or not any(pathlib.Path(self.dir).glob("*.orbax-checkpoint-tmp*")):
                break
        self.run.check_fence()  # a save the lease's fence stopped: that is the reason
        steps = self.steps()
        reason = SAVE_ERRORS.reason()
        raise RunError(f"saving checkpoint {step} in {self.dir} failed ({reason}); "
                       + (f"the newest complete checkpoint is {steps[-1]}: fix the cause, then continue with "
                          "--resume" if steps else "there is no complete checkpoint yet: fix the cause, then --resume "
                          "starts the run again from step 0"))

    def purge_deleted(self, unfinished: bool = False) -> None:
        """Delete what lies in RUN/checkpoints/.deleting/: old checkpoints already renamed out of the way
        by orbax's rotation, whole or half deleted by a process that was killed. `unfinished`: also the
        partial files of saves that never completed (none may be in flight). Only the holder of the
        run's lock calls it."""
        if not self.run.remote:
            ckpt = pathlib.Path(self.dir)
            for leftover in [ckpt / DELETING, *(ckpt.glob("*.orbax-checkpoint-tmp*") if unfinished else [])]:
                shutil.rmtree(leftover, ignore_errors=True)
        elif unfinished:  # in a bucket a save writes under its step's own name: those without a commit marker
            complete = set(self.steps())
            for name in self.run.names(CHECKPOINTS):
                if name.isdigit() and int(name) not in complete:
                    with contextlib.suppress(Exception):  # no access: the next save of that step replaces them
                        self.run.fs.rm(f"{self.run.root}/{CHECKPOINTS}/{name}", recursive=True)
            forget_listings(self.dir)

    def restore(self, abstract_state, say, tokens_per_step: int | None = None):
        """(state, step) from the newest checkpoint that restores. Damaged newer ones are moved aside to
        checkpoints-damaged/ (never deleted), saying which and why; a checkpoint whose tree differs from
        this run's (another model or optimizer) is a RunError naming the differing keys. `tokens_per_step`:
        the tokens of every step so far when the run's record fixes them (rundir.Run.tokens_per_step), which
        a format 2 checkpoint's unfingerprinted count must agree with (fingerprints.tokens_problem)."""
        import orbax.checkpoint as ocp

        mngr = self.manager()
        damaged = []
        for step in sorted(mngr.all_steps(), reverse=True):
            try:
                saved = saved_tree(mngr, step)
            except Exception as e:
                damaged.append((step, checkpoint_problem(e)))
                continue
            if saved is None:
                damaged.append((step, "its description of the arrays (_METADATA) is missing or unreadable"))
                continue
            try:
                custom = self.custom_metadata(step)
            except ValueError as e:
                damaged.append((step, str(e)))
                continue
            newer = formats.too_new(f"checkpoint {step} in {self.dir}", custom)
            if newer:  # not damage: moved nowhere
                raise RunError(newer)
            try:
                number = self.format_of(step, custom)
            except ValueError as e:
                damaged.append((step, str(e)))
                continue
            mismatch = fingerprints_lib.tree_mismatch(saved, abstract_state)
            if mismatch:
                logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # as below: the caller exits
                raise RunError(f"checkpoint {step} in {self.dir} does not fit this run's model and optimizer "
                               f"({mismatch}); resume with the run's own model settings")
            try:
                state = mngr.restore(step, args=ocp.args.StandardRestore(abstract_state))
                corrupt = (fingerprints_lib.fingerprint_problem(custom, number, state)
                           or fingerprints_lib.step_problem(state, step)
                           or fingerprints_lib.tokens_problem(custom, number, step, tokens_per_step))
            except Exception as e:  # a damaged checkpoint: a file missing, an array unreadable
                logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # its other reads' "never retrieved"
                damaged.append((step, checkpoint_problem(e)))
                continue
            if corrupt:  # it read, but not as it was written: flipped bits
                damaged.append((step, corrupt))
                continue
            if damaged:
                import jax

                if jax.process_index() == 0:  # a new save at that step must not meet the damaged directory
                    for bad, _ in damaged:
                        self.move_aside(bad)
                if jax.process_count() > 1:
                    from jax.experimental import multihost_utils

                    multihost_utils.sync_global_devices("damaged checkpoints moved aside")
                forget_listings(self.dir)
                mngr.reload()
                say(f"checkpoint {', '.join(str(d) for d, _ in damaged)} cannot be restored "
                    f"({'; '.join(f'{d}: {why}' for d, why in damaged)}); moved to {self.damaged_dir()}; "
                    f"resuming from checkpoint {step}, the newest intact one")
            if number == 1:
                say(fingerprints_lib.unverified(step, self.dir))
            return state, step
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # "Future exception was never retrieved"
        step, why = damaged[0]
        raise RunError(f"checkpoint {step} in {self.dir} cannot be restored: {why}" +
                       (f"; nor can the {len(damaged) - 1} older one(s)" if len(damaged) > 1 else ""))

    def move_aside(self, step: int) -> str:
        """Move checkpoint `step` whole into RUN/checkpoints-damaged/ as <step> (<step>.1, .2, ... when an
        earlier one of that step lies there already); returns the name it got (see storage.RunDir.move:
        a stop in the middle leaves both, never neither)."""
        taken = set(self.run.names(DAMAGED))
        name = next(n for n in itertools.chain([str(step)], (f"{step}.{i}" for i in itertools.count(1)))
                    if n not in taken)
        self.run.move(f"{CHECKPOINTS}/{step}", f"{DAMAGED}/{name}")
        return name


def keeping(ocp, keep: int | None) -> dict:
    """CheckpointManagerOptions' arguments that keep the newest `keep` checkpoints (None: all): a
    preservation policy (LatestN) where the installed orbax has them, else its older max_to_keep."""
    policies = getattr(ocp, "checkpoint_managers", None)
    fields = getattr(ocp.CheckpointManagerOptions, "__dataclass_fields__", {})
    if hasattr(policies, "LatestN") and "preservation_policy" in fields:
        return {"preservation_policy": policies.LatestN(n=keep)} if keep is not None else {}
    return {"max_to_keep": keep}


def fenced_commit(fence):
    """orbax's commit of a checkpoint in an object store (its commit marker, commit_success.txt, written
    once every array is: until then the step's objects are no checkpoint), behind the run's `fence`: a
    holder that lost the run's lease while its save was in flight (paused past the lease, and the run
    taken over meanwhile) never commits a step, whatever it had written by then."""
    import asyncio

    import orbax.checkpoint as ocp

    class FencedCommitFile(ocp.path.atomicity.CommitFileTemporaryPath):
        async def finalize(self, *args, **kwargs):
            await asyncio.to_thread(fence)  # raises (the save fails) when the lease is no longer this process's
            await super().finalize(*args, **kwargs)

    return FencedCommitFile


def forget_listings(url) -> None:
    """orbax lists a bucket through etils.epath's own fsspec filesystem, whose cached listings do not see
    what another client changed (a checkpoint moved aside): drop them."""
    if not storage.is_url(url):
        return
    from etils import epath

    try:
        epath.backend.fsspec_backend.fs(str(url)).invalidate_cache()
    except Exception:  # another epath backend, without a cache of ours to drop
        pass


# ----------------------------------------------------------------------------------------------
# What is wrong with a checkpoint, in the user's terms


@functools.cache
def tensorstore_authenticated(bucket: str) -> None:
    """Have tensorstore (orbax's arrays in gs://) find its credentials now, once a process, its stderr kept
    aside meanwhile: it says which ones it uses in an INFO line ("I1127 ... Using GOOGLE_AUTH_TOKEN_FOR_TESTING"
    with the local bucket, "... using service account" on a VM) that no setting silences (its Python module
    sets its log's threshold to INFO). What else it said there (an ERROR: no credentials found) goes on."""
    import tensorstore as ts

    sys.stderr.flush()
    with tempfile.TemporaryFile() as said:
        kept = os.dup(2)
        os.dup2(said.fileno(), 2)
        try:  # one read of an object that need not exist: the request that makes it authenticate
            ts.KvStore.open({"driver": "gcs", "bucket": bucket}).result().read(".credentials-probe").result()
        except Exception:  # no access, no network: the checkpoints' own requests say so
            pass
        finally:
            os.dup2(kept, 2)
            os.close(kept)
        said.seek(0)
        for line in said.read().decode(errors="replace").splitlines(keepends=True):
            if not re.match(r"I\d{4} [\d:.]+ +\d+ \S+:\d+\] ", line):
                sys.stderr.write(line)


REPLICA_SLICE_BYTES = 1 << 20  # a replicated array smaller than this per replica is written by one replica


@functools.cache
def _small_arrays_written_whole() -> None:
    """orbax splits the writing of a replicated array among its replicas, slicing it on the devices: one
    eagerly compiled slice per array shape and device count (64 for a small model on 8 devices, seconds of
    compilation at a run's first save) for arrays whose slices are too small for the split to pay. Arrays
    whose slices would be under REPLICA_SLICE_BYTES are written whole by one replica; the files are the same."""
    import jax
    import orbax.checkpoint as ocp

    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # not orbax's warning that a registered handler is replaced: this is the point
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=REPLICA_SLICE_BYTES),
            override=True)
    finally:
        absl.setLevel(level)


def saved_tree(mngr, step: int):
    """Checkpoint `step`'s own description of its arrays (orbax's metadata tree), None where it has none."""
    saved = mngr.item_metadata(step)
    return getattr(saved, "tree", saved)


def host_arrays(mngr, step: int):
    """The restore target of a reader: every array of checkpoint `step` as a numpy array in host memory, its
    shape and dtype as saved. Without a target orbax would place each array as it was sharded when saved,
    i.e. a replicated one on every device (a 7B model 8 times over on an 8-GPU host, read 8 times), for
    readers that want it once, on the host."""
    import jax
    import numpy as np

    saved = saved_tree(mngr, step)
    if saved is None:
        raise ValueError("its description of the arrays (_METADATA) is missing or unreadable")
    # a numpy leaf is restored as numpy (its shape and dtype, as saved): a broadcast zero takes no memory
    return jax.tree.map(lambda m: np.broadcast_to(np.zeros((), m.dtype), m.shape), saved)


def checkpoint_problem(error: BaseException) -> str:
    """Why a checkpoint cannot be restored, in one line of the user's terms (an array's name, a
    missing file), without the storage library's internals."""
    chain = []
    while error is not None and len(chain) < 10:
        chain.append(error)
        error = error.__cause__ or error.__context__
    for e in reversed(chain):  # the innermost cause names the array: Error reading "params.wte/0.0" ...: why
        match = re.search(r'Error reading "([^"/]+)[^"]*".*?: ([^;]+)', str(e))
        if match:
            why = match.group(2).split(" [tensorstore_spec")[0].strip()
            return f"array {match.group(1)} cannot be read ({why[:160]})"
    text = (str(chain[0]).splitlines() or [type(chain[0]).__name__])[0]
    text = re.split(r"\s*See full TensorStore|\s*<bound method", text)[0]
    return text[:200] or type(chain[0]).__name__


class SaveErrors(logging.Filter):
    """On orbax's logger: keeps its error reports (a background save that failed) for the one line
    Checkpoints.wait gives, instead of their tracebacks on stderr."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def filter(self, record) -> bool:
        if record.levelno < logging.ERROR:
            return True
        self.messages.append(record.getMessage())
        return False

    def reason(self) -> str:
        """The first failure, in a few words: an object store's answer or the system's reason when
        there is one."""
        for problem in (store_problem, lambda message: storage.os_problem(RuntimeError(message))):
            for message in self.messages:
                why = problem(message)
                if why:
                    return why
        return (self.messages[0].split("\n")[0][:200] if self.messages else "no reason given")


def store_problem(message: str) -> str | None:
    """A write that an object store refused, from tensorstore's or gcsfs's error: the HTTP status and the
    first sentence of the store's reason ("HTTP 403: ... does not have storage.objects.create access to
    the Google Cloud Storage object"); None for any other error."""
    code = re.search(r"http_response_code='(\d+)'", message)  # tensorstore (the arrays)
    said = re.search(r"Error writing (?:\"[^\"]*\" in OCDBT database at )?\S+: ([^\[]+)", message)
    if code and said:
        return f"HTTP {code.group(1)}: {said.group(1).split('. ')[0].strip()}"
    said = re.search(r"\b(Forbidden|Bad Request): https?://\S+\n(.+)", message)  # gcsfs (orbax's metadata files)
    if said:
        code = {"Forbidden": 403, "Bad Request": 400}[said.group(1)]
        return f"HTTP {code}: {said.group(2).split('. ')[0].strip()}"
    return None


SAVE_ERRORS = SaveErrors()  # one for the process: orbax logs through the one absl logger


def drop_closed_loop_errors(unraisable, then=sys.__unraisablehook__) -> None:
    """A sys.unraisablehook for checkpoints: when one read or write fails, tensorstore finishes the
    other parallel ones on orbax's already closed asyncio loop, and each would print an 'Event loop is
    closed' traceback (or, at exit, an ImportError of the interpreter shutting down) that buries the
    one-line error. And the reads left unawaited by the failed one are closed when collected: orbax's
    read coroutine answers the close with an exception of its own (`Encountered error while reading
    array index`, dozens of lines of TensorStore spec each), again after the error was reported.
    Drop exactly those; anything else goes on to `then` (the hook this one was put before). It stays for
    the process's end, when the last of those reads end."""
    e = unraisable.exc_value
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine's, when one is being closed
    orbax_coroutine = code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename
    if not ((unraisable.exc_type is RuntimeError and "Event loop is closed" in str(e)) or
            (unraisable.exc_type is ImportError and "shutting down" in str(e)) or orbax_coroutine):
        then(unraisable)
