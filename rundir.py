"""The run directory: every file of a run, wherever it lives, and loading what a run holds.

    RUN/config.yaml             the effective config (config.py's dataclasses, the model fully resolved)
    RUN/data.json               the data it trained on: dir, index, tokenizer and its sha256, vocab_size, kind
    RUN/tokenizer.json          a copy of the data's tokenizer, so the run decodes without the corpus
    RUN/metrics.jsonl           one JSON object per logged step
    RUN/summary.json            where training ended
    RUN/.lock                   who writes the run now (train.py, an import): one writer at a time
    RUN/wandb_id.txt            the W&B run id: a resume and eval.py log into the same W&B run
    RUN/eval/step<N>.json       eval.py's results for checkpoint N
    RUN/checkpoints/<step>/     orbax checkpoints of the state {params, opt_state, step, rng}, each with a
                                fingerprint of every array in its metadata, checked on every restore
    RUN/checkpoints/.deleting/  old checkpoints being deleted: renamed here first, so that a kill during
                                a deletion never leaves half a checkpoint under its step's name
    RUN/checkpoints-damaged/    checkpoints a resume could not restore, moved aside (never deleted): <step>/,
                                or <step>.1/, ... for a step damaged again

`Run` is a storage.RunDir (a local path, or a URL such as gs://bucket/runs/x, whose files go
through fsspec and whose checkpoints orbax writes itself) that knows these files. train.py writes a
run; eval.py, sample.py and convert_torch.py read it through `Run.config`, `Run.load_model`,
`Run.load_params` and `Run.tokenizer`; convert_torch.py's import writes one with `Run.save_params`.

A run directory a user points at that is not one, a checkpoint that cannot be read (its arrays,
its metadata) or that does not fit the model: a RunError, one line in the user's terms.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import math
import os
import pathlib
import re
import shutil
import socket
import sys
import threading
import time
import typing

import yaml

import config as config_lib
import shards
import storage
from errors import RunError, UserError

CONFIG = "config.yaml"
DATA = "data.json"
TOKENIZER = "tokenizer.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
WANDB_ID = "wandb_id.txt"
CHECKPOINTS = "checkpoints"
DAMAGED = "checkpoints-damaged"
DELETING = ".deleting"  # inside RUN/checkpoints
LOCK = ".lock"
LEASE_RENEW = 10.0  # seconds between a lease's heartbeats (a run directory in an object store)
LEASE_TTL = 60.0  # a lease whose heartbeat is older than this is free: its holder is gone
LEASE_TTL_ENV = "GPT_LEASE_TTL"  # seconds, instead of LEASE_TTL; the lease is then renewed every sixth of it
LEASE_SETTLE = 1.0  # seconds between writing a lease and reading it back
FINGERPRINTS = "fingerprints"  # the key of a checkpoint's custom metadata that holds them
TOKENS = "tokens"  # ... and the one of the tokens trained up to it (context and batch may change on resume)


def lease_times() -> tuple[float, float]:
    """(seconds a lease lasts, seconds between its heartbeats): LEASE_TTL and LEASE_RENEW, or with
    GPT_LEASE_TTL=SECONDS set that and a sixth of it. A shorter lease lets a resume after a kill go ahead
    sooner; at least 6 s, as a bucket takes about one write of an object per second."""
    text = os.environ.get(LEASE_TTL_ENV, "").strip()
    if not text:
        return LEASE_TTL, LEASE_RENEW
    try:
        ttl = float(text)
    except ValueError:
        ttl = math.nan
    if not (math.isfinite(ttl) and ttl >= 6):
        raise RunError(f"{LEASE_TTL_ENV}={text}: the seconds a run directory's lease in a bucket lasts, a number "
                       f"of at least 6 (it is renewed every sixth of them); unset, {LEASE_TTL:.0f}")
    return ttl, ttl / 6


def eval_results_name(step: int) -> str:
    """eval.py's results file for checkpoint `step`."""
    return f"eval/step{step}.json"


class Run(storage.RunDir):
    """A run directory and the files in it (see the module docstring)."""

    # ------------------------------------------------------------------------------------------
    # config.yaml

    def config(self, overrides: typing.Sequence[str] = ()) -> config_lib.Config:
        """The run's effective config (with `overrides`), for resume, eval, sample and convert."""
        if not self.is_file(CONFIG):
            raise RunError(f"{self} is not a run directory: {CONFIG} not found in it")
        text = self.read_bytes(CONFIG)
        raw = config_lib.apply_overrides(config_lib.parse_yaml(text, self.show(CONFIG)), overrides)
        sizes = config_lib.load_model_sizes() if config_lib.MODEL_SIZES.is_file() else {}  # the model is resolved
        return config_lib.from_dict(raw, sizes=sizes)

    def save_config(self, cfg: config_lib.Config) -> str:
        """Write config.yaml at once (a crash never leaves half a config); returns how it is named."""
        header = "# The effective config of this run (written by train.py); `python train.py --resume` reads it.\n"
        self.write_text(CONFIG, header + yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False))
        return self.show(CONFIG)

    def check_new(self) -> None:
        """A new run may start here: nothing is in the directory yet (but perhaps a lock)."""
        if not set(self.names()) - {LOCK}:
            return
        if self.is_file(CONFIG) and not self.checkpoint_steps():
            raise RunError(f"run directory {self} holds a run stopped before its first checkpoint; continue it "
                           f"with --resume (from step 0, with its saved config), or remove the directory to start anew")
        raise RunError(f"run directory {self} already exists; continue it with --resume, "
                       f"or start a new run elsewhere with run_dir=PATH")

    # ------------------------------------------------------------------------------------------
    # The lock: one writer at a time

    @contextlib.contextmanager
    def writer(self, purpose: str):
        """Hold RUN/.lock while writing the run (`purpose` names the writer to a second one, which gets
        a RunError naming the first). The directory must exist.

        On a local disk it is an flock, which the system drops when its process ends however it ends,
        so a killed run never blocks its resume. In an object store, which has no locks, it is a lease:
        RUN/.lock names its holder and a heartbeat renewed every LEASE_RENEW seconds, and is taken by
        writing it and reading it back; a holder whose heartbeat has stopped (a killed process) is
        waited out for at most LEASE_TTL seconds, a live one is refused (see lease_times)."""
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "purpose": purpose,
                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        release = self._lease(holder) if self.remote else self._flock(holder)
        try:
            yield
        finally:
            release()

    def _flock(self, holder: dict):
        import fcntl

        path = pathlib.Path(self.root) / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # less the umask, as every other file
        except OSError as e:
            raise RunError(f"cannot lock the run directory {self}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            other = self._holder(os.pread(fd, 4096, 0))
            os.close(fd)
            raise RunError(f"run directory {self} is in use by {other}; one process writes a run at a time "
                           f"(wait for it to end, or stop it first)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        return lambda: os.close(fd)  # the flock goes with the descriptor; the file stays (no unlink race)

    def _lease(self, holder: dict):
        ttl, every = lease_times()
        holder = {**holder, "token": os.urandom(8).hex()}
        waited = 0.0
        while True:
            try:
                raw = self.read_bytes(LOCK) if self.is_file(LOCK) else b""
            except storage.StorageError:
                raw = b""  # deleted meanwhile by its holder: free
            other = self._parse_lock(raw)
            if other and other.get("token") != holder["token"]:
                age = time.time() - float(other.get("heartbeat", 0))
                if age < ttl:
                    if age < 2 * every or waited >= ttl:  # alive: it renews its heartbeat
                        raise RunError(f"run directory {self} is in use by {self._holder(raw)}; one process writes "
                                       f"a run at a time (wait for it to end, or stop it first)")
                    print(f"{self.show(LOCK)}: held by {self._holder(raw)}, whose heartbeat stopped "
                          f"{age:.0f}s ago; waiting up to {ttl - age:.0f}s for it to expire", flush=True)
                    time.sleep(min(every, ttl - age + 0.1))
                    waited += min(every, ttl - age + 0.1)
                    continue
            self.write_text(LOCK, json.dumps({**holder, "heartbeat": time.time()}) + "\n")
            time.sleep(LEASE_SETTLE)  # a writer racing us has written by now: the store keeps the last write
            if (self._parse_lock(self.read_bytes(LOCK)) or {}).get("token") == holder["token"]:
                break
        stop = threading.Event()

        def renew():
            while not stop.wait(every):
                try:
                    self.write_text(LOCK, json.dumps({**holder, "heartbeat": time.time()}) + "\n")
                except storage.StorageError:
                    pass  # a lost write: the next one renews it

        thread = threading.Thread(target=renew, name="run-dir-lease", daemon=True)
        thread.start()

        def release():
            stop.set()
            thread.join()
            try:
                if (self._parse_lock(self.read_bytes(LOCK)) or {}).get("token") == holder["token"]:
                    self.delete(LOCK)
            except storage.StorageError:
                pass  # it expires by itself
        return release

    @staticmethod
    def _parse_lock(raw: bytes) -> dict | None:
        try:
            lock = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        return lock if isinstance(lock, dict) else None

    def _holder(self, raw: bytes) -> str:
        """The holder of a lock, in words, from the lock file's content."""
        lock = self._parse_lock(raw) or {}
        if not lock:
            return "another process"
        return f"{lock.get('purpose', 'a process')} (pid {lock.get('pid')} on {lock.get('host')}, since {lock.get('since')})"

    # ------------------------------------------------------------------------------------------
    # The data: data.json and tokenizer.json

    def save_data(self, data_dir: str, index: dict) -> None:
        """Record the prepared data the run trains on (`data_dir` as the config holds it: a URL or a
        resolved path), with the object store's version of each of its files for a URL, and copy its
        tokenizer."""
        source = shards.Source(data_dir)
        ref = {
            "dir": data_dir,
            "index": source.show("index.json"),
            "tokenizer": source.show(index["tokenizer"]),
            "tokenizer_sha256": index.get("tokenizer_sha256"),
            "vocab_size": index["vocab_size"],
            "kind": index.get("kind", "text"),  # prompt_completion: sample.py completes prompts like training
        }
        if source.remote:  # what check_data compares at a resume
            ref["versions"] = shards.versions(data_dir)
        self.write_text(DATA, json.dumps(ref, indent=2) + "\n")
        self.write_bytes(TOKENIZER, shards.tokenizer_bytes(data_dir))

    def check_data(self, data_dir: str) -> None:
        """A resume trains on the files it started with: at a URL, a file whose object-store version
        differs from the one data.json records (rewritten, prepared again) is a RunError, as the batches
        would no longer be the ones the run's steps were numbered by."""
        recorded = self.data()
        if recorded.get("dir") != data_dir or not isinstance(recorded.get("versions"), dict):
            return
        now = shards.versions(data_dir) or {}
        changed = sorted(name for name, version in recorded["versions"].items() if now.get(name) != version)
        if changed:
            raise RunError(f"data.dir {data_dir} changed since this run started: {changed[0]}"
                           + (f" and {len(changed) - 1} more files differ" if len(changed) > 1 else " differs")
                           + f" from the versions {self.show(DATA)} records; resume on the data it "
                           f"trained on, or start a new run (training.init_from={self})")

    def data(self) -> dict:
        """data.json ({} for a run without one, e.g. an import)."""
        if not self.is_file(DATA):
            return {}
        try:
            recorded = json.loads(self.read_text(DATA))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RunError(f"{self.show(DATA)} is not JSON ({e})") from None
        if not isinstance(recorded, dict):
            raise RunError(f"{self.show(DATA)} is not a JSON object")
        return recorded

    def is_finetuned(self) -> bool:
        """Whether the run trained on prompt/completion pairs."""
        return shards.is_prompt_completion(self.data())

    def tokenizer(self):
        """The run's tokenizers.Tokenizer."""
        from tokenizers import Tokenizer

        if not self.is_file(TOKENIZER):
            raise RunError(f"{self} has no {TOKENIZER}")
        try:
            return Tokenizer.from_str(self.read_text(TOKENIZER))
        except Exception as e:  # a damaged file
            reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise RunError(f"cannot load {self.show(TOKENIZER)}: {reason}") from None

    # ------------------------------------------------------------------------------------------
    # Logs

    def metrics(self, start_step: int) -> storage.JsonLines:
        """metrics.jsonl, continued after `start_step` (the rows of later steps are dropped)."""
        return storage.JsonLines(self, METRICS, keep=lambda row: row["step"] <= start_step)

    def wandb_id(self, new: str | None = None) -> str | None:
        """The run's W&B id; when it has none and `new` is given, `new` becomes it."""
        if self.is_file(WANDB_ID):
            return self.read_text(WANDB_ID).strip()
        if new is not None:
            self.write_text(WANDB_ID, new + "\n")
        return new

    def save_summary(self, summary: dict) -> None:
        self.write_text(SUMMARY, json.dumps(summary, indent=2) + "\n")

    # ------------------------------------------------------------------------------------------
    # Checkpoints

    def checkpoint_steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first ([] when there are none), as orbax counts
        them: locally a step's directory appears only once complete; in a bucket a step's objects make
        a checkpoint only once its save has written the commit marker (commit_success.txt), last."""
        import orbax.checkpoint as ocp

        forget_listings(self.checkpoint_dir())  # tensorstore writes the arrays past etils' listing cache
        return sorted(ocp.path.step.checkpoint_steps(self.checkpoint_dir()))

    def checkpoint_manager(self, keep: int | None = None, async_save: bool = False):
        """An orbax CheckpointManager of RUN/checkpoints: a step directory appears only once complete,
        and (on a local disk) an old one is renamed into .deleting/ before it is deleted."""
        import orbax.checkpoint as ocp

        logging.getLogger("absl").setLevel(logging.WARNING)
        absl = logging.getLogger("absl")
        if SAVE_ERRORS not in absl.filters:  # orbax's own reports of a failed save: kept for our one line
            absl.addFilter(SAVE_ERRORS)
        sys.unraisablehook = drop_closed_loop_errors  # a failed save's reads and writes end on closed loops
        self.pending_save = None
        self.purge_deleted(unfinished=True)
        return ocp.CheckpointManager(
            self.checkpoint_dir(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 todelete_subdir=DELETING),  # object stores delete in place
            item_handlers=ocp.StandardCheckpointHandler(),  # so that a checkpoint's tree can be read before restoring
        )

    def save_checkpoint(self, mngr, step: int, state, tokens: int | None = None) -> None:
        """Save `state` as checkpoint `step` (asynchronously if `mngr` saves so), with the fingerprint of
        every array and the `tokens` trained so far in its metadata; then finish deleting the checkpoints
        that rotation retired."""
        import orbax.checkpoint as ocp

        self.check_saved(mngr)
        self.pending_save = step
        SAVE_ERRORS.messages.clear()  # what is reported from here on is this save's
        try:
            mngr.save(step, args=ocp.args.StandardSave(state), force=True,
                      custom_metadata={FINGERPRINTS: fingerprints(state),
                                       **({TOKENS: int(tokens)} if tokens is not None else {})})
        except Exception as e:  # a synchronous save that failed
            SAVE_ERRORS.messages.append(str(e))
            self.check_saved(mngr)
        self.purge_deleted()

    @staticmethod
    def checkpoint_tokens(mngr, step: int) -> int | None:
        """The tokens trained up to checkpoint `step`, as saved with it (None for a checkpoint without)."""
        tokens = (mngr.metadata(step).custom_metadata or {}).get(TOKENS)
        return int(tokens) if isinstance(tokens, int) else None

    def check_saved(self, mngr) -> None:
        """Wait for the save in flight; a RunError if it did not complete (a full disk, no access): orbax
        only logs that, and a run going on would leave the user believing in a checkpoint that is not there."""
        step, self.pending_save = self.pending_save, None
        try:
            mngr.wait_until_finished()
        except Exception as e:
            SAVE_ERRORS.messages.append(str(e))
        if step is None or step in self.checkpoint_steps():
            return
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # "Future exception was never retrieved"
        try:
            mngr.close()
        except Exception:
            pass
        for _ in range(40):  # the failed save's partial files, once its last writes (failing too) have ended
            self.purge_deleted(unfinished=True)
            time.sleep(0.05)
            if self.remote or not any(pathlib.Path(self.checkpoint_dir()).glob("*.orbax-checkpoint-tmp*")):
                break
        steps = self.checkpoint_steps()
        reason = SAVE_ERRORS.reason()
        raise RunError(f"saving checkpoint {step} in {self.checkpoint_dir()} failed ({reason}); "
                       + (f"the newest complete checkpoint is {steps[-1]}: fix the cause, then continue with "
                          f"--resume" if steps else "there is no complete checkpoint yet: fix the cause, then --resume "
                          f"starts the run again from step 0"))

    def purge_deleted(self, unfinished: bool = False) -> None:
        """Delete what lies in RUN/checkpoints/.deleting/: old checkpoints already renamed out of the way
        by orbax's rotation, whole or half deleted by a process that was killed. `unfinished`: also the
        partial files of saves that never completed (none may be in flight). Only the holder of the
        run's lock calls it."""
        if not self.remote:
            ckpt = pathlib.Path(self.checkpoint_dir())
            for leftover in [ckpt / DELETING, *(ckpt.glob("*.orbax-checkpoint-tmp*") if unfinished else [])]:
                shutil.rmtree(leftover, ignore_errors=True)
        elif unfinished:  # in a bucket a save writes under its step's own name: those without a commit marker
            complete = set(self.checkpoint_steps())
            for name in self.names_in(CHECKPOINTS):
                if name.isdigit() and int(name) not in complete:
                    with contextlib.suppress(Exception):  # no access: the next save of that step replaces them
                        self.fs.rm(f"{self.root}/{CHECKPOINTS}/{name}", recursive=True)
            forget_listings(self.checkpoint_dir())

    def damaged_dir(self) -> str:
        """RUN/checkpoints-damaged, as a local path or URL (where restore moves what it cannot read)."""
        if self.remote:
            return f"{self.location}/{DAMAGED}"
        return str(pathlib.Path(self.checkpoint_dir()).parent / DAMAGED)

    def move_aside(self, step: int) -> str:
        """Move checkpoint `step` whole into RUN/checkpoints-damaged/ as <step> (<step>.1, .2, ... when an
        earlier one of that step lies there already); returns the name it got. Locally one rename; a
        bucket, which has no folders and no rename, gets a copy of every object under the step's prefix
        (made by the store itself), then the originals are deleted: a stop in between leaves both, never
        neither."""
        aside = self.damaged_dir()
        taken = set(self.names_in(DAMAGED))
        name = next(n for n in itertools.chain([str(step)], (f"{step}.{i}" for i in itertools.count(1)))
                    if n not in taken)
        if not self.remote:
            def move():
                pathlib.Path(aside).mkdir(exist_ok=True)
                (pathlib.Path(self.checkpoint_dir()) / str(step)).rename(pathlib.Path(aside) / name)

            self._do(DAMAGED, move)
            return name
        src = f"{self.root}/{CHECKPOINTS}/{step}"
        objects = self._do(f"{CHECKPOINTS}/{step}", lambda: self.fs.find(src))
        for path in objects:
            self._do(f"{DAMAGED}/{name}", self.fs.copy, path, f"{self.root}/{DAMAGED}/{name}{path[len(src):]}")
        self._do(f"{CHECKPOINTS}/{step}", self.fs.rm, objects)
        self.fs.invalidate_cache(self.root)
        return name

    def names_in(self, sub: str) -> list[str]:
        """The names in RUN/sub ([] when there is none)."""
        path = self._path(sub)
        self.fs.invalidate_cache(path)  # what others wrote meanwhile (orbax, tensorstore) is listed too
        return self._do(sub, lambda: [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False)]
                        if self.fs.isdir(path) else [])

    def restore(self, mngr, abstract_state, say):
        """(state, step) from the newest checkpoint that restores. Damaged newer ones are moved aside to
        checkpoints-damaged/ (never deleted), saying which and why; a checkpoint whose tree differs from
        this run's (another model or optimizer) is a RunError naming the differing keys."""
        import orbax.checkpoint as ocp

        ckpt_dir = self.checkpoint_dir()
        default_hook, sys.unraisablehook = sys.unraisablehook, drop_closed_loop_errors
        damaged = []
        for step in sorted(mngr.all_steps(), reverse=True):
            try:
                saved = mngr.item_metadata(step)
                saved = getattr(saved, "tree", saved)  # the checkpoint's own description of its arrays
            except Exception as e:
                damaged.append((step, checkpoint_problem(e)))
                continue
            if saved is None:
                damaged.append((step, "its description of the arrays (_METADATA) is missing or unreadable"))
                continue
            mismatch = tree_mismatch(saved, abstract_state)
            if mismatch:
                logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # as below: the caller exits
                raise RunError(f"checkpoint {step} in {ckpt_dir} does not fit this run's model and optimizer "
                               f"({mismatch}); resume with the run's own model settings")
            try:
                state = mngr.restore(step, args=ocp.args.StandardRestore(abstract_state))
                corrupt = fingerprint_problem(mngr, step, state)
            except Exception as e:  # a damaged checkpoint: a file missing, an array unreadable
                damaged.append((step, checkpoint_problem(e)))
                continue
            if corrupt:  # it read, but not as it was written: flipped bits
                damaged.append((step, corrupt))
                continue
            sys.unraisablehook = default_hook
            if damaged:
                import jax

                if jax.process_index() == 0:  # a new save at that step must not meet the damaged directory
                    for bad, _ in damaged:
                        self.move_aside(bad)
                if jax.process_count() > 1:
                    from jax.experimental import multihost_utils

                    multihost_utils.sync_global_devices("damaged checkpoints moved aside")
                forget_listings(ckpt_dir)
                mngr.reload()
                say(f"checkpoint {', '.join(str(d) for d, _ in damaged)} cannot be restored "
                    f"({'; '.join(f'{d}: {why}' for d, why in damaged)}); moved to {self.damaged_dir()}; "
                    f"resuming from checkpoint {step}, the newest intact one")
            return state, step
        # (the hook stays: the caller exits)
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # "Future exception was never retrieved"
        step, why = damaged[0]
        raise RunError(f"checkpoint {step} in {ckpt_dir} cannot be restored: {why}" +
                       (f"; nor can the {len(damaged) - 1} older one(s)" if len(damaged) > 1 else ""))

    def load_params(self, step: int | None = None) -> tuple[dict, int]:
        """(params, step) of a checkpoint, the last one by default: a pure dict of numpy arrays with
        integer block indices, as `nnx.to_pure_dict` gives them (orbax hands dict keys back as strings).
        For init_from, export, eval and sampling."""
        import numpy as np
        import orbax.checkpoint as ocp

        ckpt_dir = self.checkpoint_dir()
        steps = self.checkpoint_steps()
        if not steps:
            raise RunError(f"no checkpoint in {ckpt_dir}")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise RunError(f"no checkpoint for step {step} in {ckpt_dir}; saved steps: {', '.join(map(str, steps))}")
        sys.unraisablehook = drop_closed_loop_errors  # a failed read's other reads end on a closed loop
        with ocp.CheckpointManager(ckpt_dir) as mngr:
            try:
                state = mngr.restore(step, args=ocp.args.StandardRestore())
                corrupt = fingerprint_problem(mngr, step, state)
            except Exception as e:  # a damaged checkpoint
                logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # "Future exception was never retrieved"
                raise RunError(f"checkpoint {step} in {ckpt_dir} cannot be read: {checkpoint_problem(e)}") from None
        if corrupt:
            raise RunError(f"checkpoint {step} in {ckpt_dir} is corrupt: {corrupt}")

        def numpy_tree(tree):
            if not isinstance(tree, dict):
                return np.asarray(tree)
            return {int(k) if isinstance(k, str) and k.isdigit() else k: numpy_tree(v) for k, v in tree.items()}

        return numpy_tree(state["params"]), step

    def save_params(self, params: dict, step: int = 0) -> None:
        """A checkpoint holding only parameters (an import): what init_from, eval, sample and export read."""
        import jax
        import numpy as np

        state = {"params": jax.tree.map(np.asarray, params), "step": np.asarray(step, np.int32)}
        with self.checkpoint_manager() as mngr:
            self.save_checkpoint(mngr, step, state)
            self.check_saved(mngr)

    def load_model(self, step: int | None = None):
        """(the run's model.GPT with the checkpoint's parameters, the checkpoint step)."""
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from model import GPT

        cfg = self.config().model
        params, step = self.load_params(step)
        abstract = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(params=0)))  # shapes only, nothing computed
        graphdef, state = nnx.split(abstract)
        try:
            nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
        except (KeyError, ValueError) as e:
            raise RunError(f"checkpoint {step} of {self} does not fit its config.yaml: {e}") from None
        return nnx.merge(graphdef, state), step


def open_run(location) -> Run:
    """The run directory at a local path or URL; a `Run` is passed through."""
    return location if isinstance(location, Run) else Run(location)


def existing(location) -> Run:
    """A run directory to read (eval, sample, convert): a local one must exist; one at a URL is
    checked when its config is read."""
    location = storage.local_path(location)  # file:///x: the local directory /x
    if not storage.is_url(location) and not pathlib.Path(location).is_dir():
        raise RunError(f"run directory {location} not found")
    return Run(location)


# ----------------------------------------------------------------------------------------------
# Starting from another run's parameters (training.init_from)


def init_model(location) -> dict:
    """training.init_from's model section (its name and every field): a fine-tuning run's model unless
    the command line names one (`model=NAME`)."""
    try:
        return config_lib.to_dict(open_run(location).config())["model"]
    except UserError as e:
        raise RunError(f"training.init_from: {e}") from None


def check_init_from(location, mcfg) -> None:
    """training.init_from: a run directory with a checkpoint and this run's model, or a RunError (one line)."""
    try:
        src = open_run(location)
        src_model = src.config().model
        has_checkpoint = bool(src.checkpoint_steps())
    except UserError as e:
        raise RunError(f"training.init_from: {e}") from None
    if not has_checkpoint:
        raise RunError(f"training.init_from={location}: no checkpoint in it to start from")
    # an ALiBi model may change its context: only the parameters' fields must agree
    diffs = [f"{f} {getattr(src_model, f)} there, {getattr(mcfg, f)} here" for f in mcfg.PARAMETER_FIELDS
             if getattr(src_model, f) != getattr(mcfg, f) and not (f == "block_size" and mcfg.max_length is None)]
    if diffs:
        raise RunError(f"training.init_from={location}: its model differs from this run's ({'; '.join(diffs)}); "
                       f"set the same model (and prepare the data with its tokenizer)")


def load_init_params(location, shardings):
    """training.init_from: the parameters of a run directory's last checkpoint, placed with `shardings`."""
    import jax

    try:
        params, _ = open_run(location).load_params()
    except UserError as e:
        raise RunError(f"training.init_from: {e}") from None
    return jax.device_put(params, shardings)


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


def named_leaves(tree) -> list[tuple[str, typing.Any]]:
    """(path/of/the/leaf, leaf) of a state tree; block indices read the same as ints or as orbax's strings."""
    import jax

    name = lambda k: getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))  # noqa: E731  (dict, list, attr)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [("/".join(str(name(k)) for k in path), leaf) for path, leaf in flat]


def fingerprints(tree) -> dict[str, str]:
    """A 64-bit fingerprint of every array of a state, as 16 hex digits by leaf name.

    For an array whose elements, read as unsigned integers of their width (widened to uint32; an
    8-byte element as two), are u_i at row-major position i, it is the pair of uint32 sums (mod 2**32)
        sum_i u_i * (2*i*0x9E3779B1 + 1)      and      sum_i rotl(u_i, 13) * (2*i*0x85EBCA77 + 0x27D4EB2F)
    Every multiplier is odd, so any one flipped bit changes both sums; the weights depend on the
    position, so moved elements change them too. It is computed where the arrays are (a sharded
    state on its devices, by every process alike), one read of the state, and never gathers an
    array onto one host."""
    import jax

    names, leaves = zip(*named_leaves(tree)) if jax.tree.leaves(tree) else ((), ())
    sums = jax.device_get(_fingerprint_fn()(list(leaves)))
    return {n: f"{int(a):08x}{int(b):08x}" for n, (a, b) in zip(names, sums)}


@functools.cache
def _fingerprint_fn():
    import jax
    import jax.numpy as jnp
    import numpy as np

    def one(x):
        x = jnp.asarray(x)
        if x.dtype == jnp.bool_:
            u = x.astype(jnp.uint32)
        else:
            width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
            u = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)  # 8 bytes: a last axis of 2
        i = jnp.zeros(u.shape, jnp.uint32)  # the row-major position, without reshaping a sharded array
        for axis, size in enumerate(u.shape):
            i = i * np.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, u.shape, axis)
        a = jnp.sum(u * (i * np.uint32(2 * 0x9E3779B1 % 2**32) + np.uint32(1)), dtype=jnp.uint32)
        r = (u << np.uint32(13)) | (u >> np.uint32(19))
        b = jnp.sum(r * (i * np.uint32(2 * 0x85EBCA77 % 2**32) + np.uint32(0x27D4EB2F)), dtype=jnp.uint32)
        return jnp.stack([a, b])

    return jax.jit(lambda leaves: [one(x) for x in leaves])


def fingerprint_problem(mngr, step: int, state) -> str | None:
    """Which arrays of a restored checkpoint differ from the fingerprints saved with it (None when all
    agree, or for a checkpoint saved without them)."""
    saved = (mngr.metadata(step).custom_metadata or {}).get(FINGERPRINTS)
    if not isinstance(saved, dict):
        return None
    now = fingerprints(state)
    bad = sorted(name for name in saved.keys() & now.keys() if saved[name] != now[name])
    if not bad:
        return None
    return (f"array {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else "") +
            " read back other than saved (its fingerprint differs): the files were altered or damaged")


def tree_mismatch(saved, abstract_state) -> str | None:
    """How a checkpoint's tree (its metadata) and this run's state differ: keys on one side only and
    arrays of another shape, the first few of each; None when they agree."""
    def shapes(tree) -> dict[str, tuple | None]:
        return {name: getattr(leaf, "shape", None) for name, leaf in named_leaves(tree)}

    def show(names) -> str:  # the parameters first: they say what differs in the model
        first = sorted(names, key=lambda n: (not n.startswith("params/"), n))[:4]
        return ", ".join(first) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    there, here = shapes(saved), shapes(abstract_state)
    resized = [f"{k} {tuple(there[k])} there, {tuple(here[k])} here" for k in sorted(
        there.keys() & here.keys(), key=lambda n: (not n.startswith("params/"), n))
        if None not in (there[k], here[k]) and tuple(there[k]) != tuple(here[k])]
    parts = ([f"only in the checkpoint: {show(there.keys() - here.keys())}"] if there.keys() - here.keys() else []) + \
            ([f"only in this run: {show(here.keys() - there.keys())}"] if here.keys() - there.keys() else []) + \
            ([f"other shapes: {', '.join(resized[:3])}" + (f" and {len(resized) - 3} more" if len(resized) > 3 else "")]
             if resized else [])
    return "; ".join(parts) or None


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
    check_saved gives, instead of their tracebacks on stderr."""

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


def drop_closed_loop_errors(unraisable) -> None:
    """A sys.unraisablehook for checkpoints: when one read or write fails, tensorstore finishes the
    other parallel ones on orbax's already closed asyncio loop, and each would print an 'Event loop is
    closed' traceback (or, at exit, an ImportError of the interpreter shutting down) that buries the
    one-line error. Drop exactly those."""
    e = unraisable.exc_value
    if not ((unraisable.exc_type is RuntimeError and "Event loop is closed" in str(e)) or
            (unraisable.exc_type is ImportError and "shutting down" in str(e))):
        sys.__unraisablehook__(unraisable)
