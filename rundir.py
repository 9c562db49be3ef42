"""The run directory: every file of a run, wherever it lives, and loading what a run holds.

    RUN/config.yaml             the effective config (config.py's dataclasses, the model fully resolved)
    RUN/format.json             the format the run was last written in (formats.py; none before format 3)
    RUN/data.json               the data it trained on: dir, index, tokenizer and its sha256, vocab_size, kind
    RUN/tokenizer.json          a copy of the data's tokenizer, so the run decodes without the corpus
    RUN/metrics.jsonl           one JSON object per logged step
    RUN/summary.json            where training ended
    RUN/loss.png                the training and validation loss by step (drawn at each evaluation)
    RUN/.lock                   who writes the run now (train.py, an import): one writer at a time
    RUN/wandb_id.txt            the W&B run id: a resume and eval.py log into the same W&B run
    RUN/lora_base.json          a LoRA run's frozen base: training.init_from, its checkpoint step, a fingerprint
    RUN/eval/step<N>.json       eval.py's results for checkpoint N
    RUN/checkpoints/            orbax checkpoints of the state (checkpoints.py: saving, restoring past
    RUN/checkpoints-damaged/    damaged ones, which are moved aside, fingerprints)

`Run` is a storage.RunDir (a local path, or a URL such as gs://bucket/runs/x, whose files go
through fsspec and whose checkpoints orbax writes itself) that knows these files. train.py writes a
run; eval.py, sample.py and convert_torch.py read it through `Run.config`, `Run.load_model`,
`Run.load_params` and `Run.tokenizer`; convert_torch.py's import writes one with `Run.save_params`.
Every checkpoint is saved, restored and loaded through one owner, `Run.checkpoints()`, a
checkpoints.Checkpoints.

A LoRA run (training.lora) checkpoints its adapters only; `Run.load_params` gives its merged model (the
base that lora_base.json names, checked to be the same weights, with the adapters folded in), so the
readers above need not know LoRA.

A run directory a user points at that is not one, a checkpoint that cannot be read (its arrays,
its metadata) or that does not fit the model: a RunError, one line in the user's terms.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import pathlib
import socket
import threading
import time
import typing

import yaml

import checkpoints as checkpoints_lib
import config as config_lib
import formats
import multihost
import shards
import storage
from errors import RunError, UserError

CONFIG = "config.yaml"
DATA = "data.json"
TOKENIZER = "tokenizer.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
WANDB_ID = "wandb_id.txt"
LORA_BASE = "lora_base.json"
LOCK = ".lock"
LEASE_RENEW = 10.0  # seconds between a lease's heartbeats (a run directory in an object store)
LEASE_TTL = 60.0  # a lease whose heartbeat is older than this is free: its holder is gone
LEASE_TTL_ENV = "GPT_LEASE_TTL"  # seconds, instead of LEASE_TTL; the lease is then renewed every sixth of it
LEASE_SETTLE = 1.0  # seconds between writing a lease and reading it back


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


class _Lease:
    """A held lease on RUN/.lock in an object store: renewed every `every` seconds by a thread, each
    renewal conditional on the generation written last (where the store has generations). `check`
    (the run's fence) raises a RunError once the lease is lost: a renewal refused because another
    process holds the lock now, or, when no renewal has gone through for two periods (this process
    was paused), a look at the lock that finds another generation there."""

    def __init__(self, run: Run, holder: dict, generation: int | None, every: float):
        self.run, self.holder, self.generation, self.every = run, holder, generation, every
        self.confirmed = time.monotonic()  # when the lease was last known to be ours
        self.lost: str | None = None  # why it was lost
        self.guard = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._renew_loop, name="run-dir-lease", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()

    def _content(self) -> bytes:
        return (json.dumps({**self.holder, "heartbeat": time.time()}) + "\n").encode()

    def _renew_loop(self) -> None:
        while not self.stopping.wait(self.every) and not self.lost:
            try:
                self.renew()
            except storage.StorageError:
                pass  # the store unreachable: the next renewal tries again (check() looks if it drags on)

    def renew(self) -> None:
        with self.guard:
            if self.lost:
                return
            try:
                generation = storage.Versions(self.run).write_if(LOCK, self._content(), self.generation)
            except storage.Conflict:
                self._lost_to_whoever_holds_it()
                return
            self.generation, self.confirmed = generation, time.monotonic()

    def _lost_to_whoever_holds_it(self) -> None:
        """A conditional renewal failed: lost, unless the lock holds our own token (our last write went
        through but its answer did not reach us), whose generation is then adopted."""
        try:
            generation, raw = storage.Versions(self.run).versioned(LOCK)
        except storage.StorageError:
            generation, raw = None, b""
        lock = self.run._parse_lock(raw) or {}
        if lock.get("token") == self.holder["token"]:
            self.generation, self.confirmed = generation, time.monotonic()
            return
        self.lost = f"{self.run._holder(raw)} holds it now" if lock else "its lock was deleted"

    def check(self) -> None:
        """The run's fence: called before every write of the run."""
        if not self.lost and self.generation is not None and time.monotonic() - self.confirmed > 2 * self.every:
            self.renew()  # renewals stopped for a while (this process paused?): is the lease still ours?
        if self.lost:
            raise RunError(f"this process lost the lease on {self.run} ({self.lost}: it was paused or cut off "
                           f"longer than the lease lasts); it stops without writing anything more into the run")


def eval_results_name(step: int) -> str:
    """eval.py's results file for checkpoint `step`."""
    return f"eval/step{step}.json"


MEASURED = ("data", "split", "split_tokens", "max_tokens")  # the fields of a results row that name its series


def results_problem(results) -> str | None:
    """Why a parsed results file is not one eval.py wrote (None if it is)."""
    if not isinstance(results, dict):
        return "not a JSON object"
    section = results.get("perplexity", {"rows": []})
    rows = section.get("rows") if isinstance(section, dict) else None
    # the fields that merging, the plot and wandb read
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("length"), int)
                                             and all(k in r for k in ("multiple", "loss", "ppl")) for r in rows):
        return "its perplexity section has no list of rows with length, multiple, loss and ppl"
    if not all(isinstance(r.get(k), (str, int, float, type(None))) for r in rows for k in MEASURED):
        return f"a perplexity row's {', '.join(MEASURED)} are not plain values"
    if not isinstance(results.get("tasks", {}), dict):
        return "its tasks section is not an object"
    return None


class Run(storage.RunDir):
    """A run directory and the files in it (see the module docstring)."""

    LOSS_PLOT = "loss.png"

    # ------------------------------------------------------------------------------------------
    # config.yaml

    def config(self, overrides: typing.Sequence[str] = ()) -> config_lib.Config:
        """The run's effective config (with `overrides`), for resume, eval, sample and convert; a run
        written in a format newer than this code reads is a RunError naming the version that reads it."""
        if not self.is_file(CONFIG):
            raise RunError(f"{self} is not a run directory: {CONFIG} not found in it")
        self.check_format()
        text = self.read_bytes(CONFIG)
        raw = config_lib.apply_overrides(config_lib.parse_yaml(text, self.show(CONFIG)), overrides)
        return config_lib.from_saved(raw)  # the model as saved, whatever conf/model_config.yaml says now

    def resume_config(self, overrides: typing.Sequence[str]) -> config_lib.Config:
        """config(overrides) for --resume, which continues the run's own model: an override that names a
        model (`model=NAME`) or changes what its parameters are (a GPTConfig.PARAMETER_FIELDS field; an
        ALiBi model's block_size aside, which only bounds its context) is a RunError in one line. How the
        model runs (model.remat, dtype, attention, dropout) may change."""
        named = [o for o in overrides if o.partition("=")[0].strip() == "model"]
        saved = self.config()
        if named:
            raise RunError(f"--resume {named[0]}: a resume continues this run's own model ({saved.model_name}); "
                           f"to train another, start a new run (training.init_from={self} starts from these weights)")
        cfg = self.config(overrides)
        changed = [f"model.{f} {getattr(saved.model, f)} -> {getattr(cfg.model, f)}" for f in cfg.model.PARAMETER_FIELDS
                   if getattr(saved.model, f) != getattr(cfg.model, f)
                   and not (f == "block_size" and cfg.model.max_length is None)]
        if changed:
            raise RunError(f"--resume cannot change the run's model ({'; '.join(changed)}): its checkpoints hold "
                           f"that model's parameters; start a new run to train another")
        was, now = saved.training.lora, cfg.training.lora
        if (was is None) != (now is None) or (was is not None and any(
                getattr(was, f) != getattr(now, f) for f in was.SHAPE_FIELDS)):
            show = lambda lora: "null" if lora is None else ", ".join(  # noqa: E731
                f"{f} {getattr(lora, f)}" for f in lora.SHAPE_FIELDS)
            raise RunError(f"--resume cannot change training.lora ({show(was)} -> {show(now)}): its checkpoints hold "
                           f"those adapters (or the whole model); start a new run to train others")
        return cfg

    # what a resume may change without a word: where things are, how often the loop logs, evaluates and
    # saves, and W&B (training.steps has its own line, about the schedule)
    UNREMARKABLE = ("run_dir", "data.dir", "training.steps", "training.log_every", "training.eval_every",
                    "training.eval_windows", "checkpoint.", "wandb.")

    def resume_changes(self, saved: config_lib.Config, cfg: config_lib.Config) -> str | None:
        """One line on what a resume's overrides change of the run as it was configured (`saved`) that its
        continuation depends on (the batch, the context, the seed, the optimizer, the model's dtype...):
        the steps after the checkpoint then differ from those the run would have had; None for nothing."""
        def flat(tree, prefix=""):
            for key, value in tree.items():
                if isinstance(value, dict):
                    yield from flat(value, f"{prefix}{key}.")
                else:
                    yield f"{prefix}{key}", value

        was, now = dict(flat(config_lib.to_dict(saved))), dict(flat(config_lib.to_dict(cfg)))
        changed = [f"{k} {was.get(k)} -> {now.get(k)}" for k in sorted(was.keys() | now.keys())
                   if was.get(k) != now.get(k) and not k.startswith(self.UNREMARKABLE)]
        if not changed:
            return None
        drawn = [k for k in ("training.batch_size", "training.seq_len", "seed", "data.batching")
                 if any(c.startswith(k + " ") for c in changed)]
        return (f"--resume changes {', '.join(changed)}: the steps from here on are not those the run would have "
                f"had with its own settings" + (f" (the batches are drawn anew for {' and '.join(drawn)})"
                                                  if drawn else "")
                + "; a resume with the saved settings continues it exactly")

    def save_config(self, cfg: config_lib.Config) -> str:
        """Write config.yaml at once (a crash never leaves half a config), and format.json: the run is
        written in this code's format from now on (a resumed older run included). Returns how the config
        is named."""
        header = "# The effective config of this run (written by train.py); `python train.py --resume` reads it.\n"
        self.write_text(formats.FILE, json.dumps(formats.record()) + "\n")
        self.write_text(CONFIG, header + yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False))
        return self.show(CONFIG)

    def check_format(self) -> None:
        """A RunError (one line) when the run directory is in a format newer than this code reads, or its
        format.json is damaged. A run from before format 3 has none: every older format is read."""
        recorded = self._json_object(formats.FILE)
        if recorded is None:
            return
        newer = formats.too_new(f"run directory {self}", recorded)
        if newer:
            raise RunError(newer)
        number = recorded.get("format")
        if not isinstance(number, int) or isinstance(number, bool) or number < formats.FIRST_RECORDED:
            raise RunError(f"{self.show(formats.FILE)} records no format this project has written (an integer from "
                           f"{formats.FIRST_RECORDED} on): it is damaged; write {json.dumps(formats.record())} into it "
                           f"if this version wrote the run")

    def check_new(self) -> None:
        """A new run may start here: nothing is in the directory yet (but perhaps a lock)."""
        if not set(self.names()) - {LOCK}:
            return
        holder = self.held_by()
        if holder:
            raise RunError(f"run directory {self} is in use by {holder}; one process writes a run at a time "
                           f"(wait for it to end, or stop it first)")
        if self.is_file(CONFIG) and not self.checkpoints().steps():
            raise RunError(f"run directory {self} holds a run stopped before its first checkpoint; continue it "
                           f"with --resume (from step 0, with its saved config), or remove the directory to start anew")
        raise RunError(f"run directory {self} already exists; continue it with --resume, "
                       f"or start a new run elsewhere with run_dir=PATH")

    # ------------------------------------------------------------------------------------------
    # The lock: one writer at a time

    @contextlib.contextmanager
    def writer(self, purpose: str, new: bool = False):
        """Hold RUN/.lock while writing the run (`purpose` names the writer to a second one, which gets
        a RunError naming the first). The directory must exist. `new`: a new run starts here, so the
        directory must hold nothing else (check_new, under the lock: no other run started meanwhile).

        On a local disk it is an flock, which the system drops when its process ends however it ends,
        so a killed run never blocks its resume. In an object store, which has no locks, it is a lease:
        RUN/.lock names its holder and a heartbeat renewed every LEASE_RENEW seconds, and is taken by
        writing it and reading it back; a holder whose heartbeat has stopped (a killed process) is
        waited out for at most LEASE_TTL seconds, a live one is refused (see lease_times)."""
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "purpose": purpose,
                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        release = self._lease(holder) if self.remote else self._flock(holder)
        try:
            if new:
                self.check_new()
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
        before = os.pread(fd, 4096, 0)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)

        def release():  # the flock goes with the descriptor; the file stays (no unlink race), as it was before
            if before:  # (its content names the holder only while the flock is held)
                os.ftruncate(fd, 0)
                os.pwrite(fd, before, 0)
            os.close(fd)
        return release

    def _lease(self, holder: dict):
        """Take the run's lease in an object store (see `writer`); returns its release. In Google Cloud
        Storage the lease is fenced: taking it is one conditional write (ifGenerationMatch: absent, or the
        expired generation that was read), every renewal replaces only the generation this process wrote
        last, and before every write of the run (`fence`) a holder whose renewals stopped for a while (a
        paused process: SIGSTOP, a VM stall, a closed laptop lid) checks that the lease is still its own.
        One that lost it stops with a RunError before writing anything more."""
        ttl, every = lease_times()
        holder = {**holder, "token": os.urandom(8).hex()}
        waited = 0.0
        while True:
            try:
                generation, raw = storage.Versions(self).versioned(LOCK)
            except storage.StorageError:
                generation, raw = None, b""  # deleted meanwhile by its holder: free
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
            content = (json.dumps({**holder, "heartbeat": time.time()}) + "\n").encode()
            try:
                mine = storage.Versions(self).write_if(LOCK, content, generation)
            except storage.Conflict:
                continue  # another writer took or renewed it between our read and our write: look again
            if mine is not None:
                break  # the store made the write conditional: the lease is ours, atomically
            time.sleep(LEASE_SETTLE)  # no generations here: a writer racing us has written by now, the last wins
            if (self._parse_lock(self.read_bytes(LOCK)) or {}).get("token") == holder["token"]:
                break
        lease = _Lease(self, holder, mine, every)
        self.fence = lease.check
        lease.start()

        def release():
            forget()
            self.fence = None
            lease.stop()
            try:
                if not lease.lost:
                    storage.Versions(self).delete_if(LOCK, lease.generation)
            except (storage.StorageError, storage.Conflict):
                pass  # taken meanwhile, or it expires by itself
        forget = multihost.at_end(release)  # also when another process ends the run: a resume need not wait
        return release

    def held_by(self) -> str | None:
        """Who holds the run's lock now, in words (see _holder), or None when no live process does: a
        local flock that can be taken, or a lease whose heartbeat is older than the lease lasts."""
        if not self.is_file(LOCK):
            return None
        if self.remote:
            raw = self.read_bytes(LOCK)
            lock = self._parse_lock(raw) or {}
            ttl, _ = lease_times()
            return self._holder(raw) if lock and time.time() - float(lock.get("heartbeat", 0)) < ttl else None
        import fcntl

        fd = os.open(pathlib.Path(self.root) / LOCK, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return self._holder(os.pread(fd, 4096, 0))
        finally:
            os.close(fd)  # a shared lock taken here goes with the descriptor
        return None

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
            "content_sha256": shards.content_sha256(index),  # what check_data compares at a resume, anywhere
        }
        if source.remote:  # what check_data compares at a resume
            ref["versions"] = shards.versions(data_dir)
        self.write_text(DATA, json.dumps(ref, indent=2) + "\n")
        self.write_bytes(TOKENIZER, shards.tokenizer_bytes(data_dir))

    def check_data(self, data_dir: str, index: dict) -> None:
        """A resume trains on the data it started with, wherever it now lies: a RunError (one line) when
        the data's tokenizer is not the run's tokenizer.json, when its content (shards.content_sha256: the
        tokenizer, every shard's size and sha256) differs from what data.json records (prepared again,
        or `data.dir` pointed elsewhere), and at a URL when a file's object-store version changed. A run
        whose data.json records no fingerprint (an older version's) has its tokenizer compared with
        the recorded one's sha256; one that records neither cannot be checked, and is refused."""
        recorded = self.data()
        if not recorded:
            return  # an import: nothing trained yet, nothing to compare
        start = f"data.dir {data_dir}"
        fix = (f"resume on the data it trained on ({recorded.get('dir')}), or start a new run from it "
               f"(training.init_from={self})")
        ours = self.tokenizer_sha256()
        if ours is not None and ours != index.get("tokenizer_sha256"):
            raise RunError(f"{start} was tokenized with another tokenizer than this run's ({self.show(TOKENIZER)}); {fix}")
        if recorded.get("content_sha256"):
            if recorded["content_sha256"] != shards.content_sha256(index):
                raise RunError(f"{start} is not the data this run trained on: its content differs from what "
                               f"{self.show(DATA)} records (prepared again, or other data); {fix}")
        elif not recorded.get("tokenizer_sha256") and ours is None:
            raise RunError(f"{self.show(DATA)} records no fingerprint of the data and {self} has no {TOKENIZER}: "
                           f"{start} cannot be checked against what the run trained on; start a new run from it "
                           f"(training.init_from={self})")
        elif recorded.get("tokenizer_sha256") and recorded["tokenizer_sha256"] != index.get("tokenizer_sha256"):
            raise RunError(f"{start} was tokenized with another tokenizer than the one {self.show(DATA)} records; {fix}")
        if recorded.get("dir") != data_dir or not isinstance(recorded.get("versions"), dict):
            return
        now = shards.versions(data_dir) or {}
        changed = sorted(name for name, version in recorded["versions"].items() if now.get(name) != version)
        if changed:
            raise RunError(f"{start} changed since this run started: {changed[0]}"
                           + (f" and {len(changed) - 1} more files differ" if len(changed) > 1 else " differs")
                           + f" from the versions {self.show(DATA)} records; {fix}")

    def tokenizer_sha256(self) -> str | None:
        """The sha256 of the run's tokenizer.json, None without one."""
        import hashlib

        return hashlib.sha256(self.read_bytes(TOKENIZER)).hexdigest() if self.is_file(TOKENIZER) else None

    def _json_object(self, name: str) -> dict | None:
        """The run's JSON file `name` as a dict (None where there is none); anything else is one RunError line."""
        if not self.is_file(name):
            return None
        try:
            recorded = json.loads(self.read_text(name))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RunError(f"{self.show(name)} is not JSON ({e})") from None
        if not isinstance(recorded, dict):
            raise RunError(f"{self.show(name)} is not a JSON object")
        return recorded

    def data(self) -> dict:
        """data.json ({} for a run without one, e.g. an import)."""
        return self._json_object(DATA) or {}

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
            reason = storage.one_line(e)
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

    def start_wandb(self, cfg: config_lib.Config):
        """The run's W&B run: a resume (and eval.py) continues the one whose id the run directory keeps."""
        import uuid

        import wandb

        return wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.wandb.name or self.name,
                          id=self.wandb_id(new=uuid.uuid4().hex[:8]), resume="allow", mode=cfg.wandb.mode,
                          dir=None if self.remote else str(self), config=config_lib.to_dict(cfg))

    def save_summary(self, summary: dict) -> None:
        self.write_text(SUMMARY, json.dumps(summary, indent=2) + "\n")

    # ------------------------------------------------------------------------------------------
    # eval.py's results: RUN/eval/step<N>.json (eval_results_name), added to section by section

    def read_results(self, name: str) -> dict:
        """The JSON results file `name` ({} if there is none yet), checked to be one that eval.py can add to."""
        if not self.is_file(name):
            return {}
        try:
            results = json.loads(self.read_text(name))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            results, why = None, f"unreadable JSON ({e})"
        else:
            why = results_problem(results)
        if why:
            raise RunError(f"{self.show(name)} is not an eval.py results file: {why}; move it away to evaluate "
                           "this step again (eval.py adds to that file and never overwrites it)")
        return results

    def write_results(self, name: str, section: str, merge: typing.Callable[[object], object]) -> object:
        """Replace one section of the JSON results file `name` by merge(its current value or None), keeping
        the other sections; the file is re-read first and replaced at once. Returns the new section."""
        results = self.read_results(name)
        results[section] = merge(results.get(section))
        bad = _non_finite(results[section], f"{section}")
        if bad:  # a NaN or an infinity is no result: say so rather than record it
            raise RunError(f"{bad} is not a finite number: the evaluation's inputs (the checkpoint, the data) are "
                           f"damaged or the model diverged; nothing was written to {name}")
        results["updated"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.write_text(name, json.dumps(results, indent=2) + "\n")
        return results[section]

    # ------------------------------------------------------------------------------------------
    # Checkpoints (checkpoints.py)

    def checkpoints(self, keep: int | None = None, async_save: bool = False, *,
                    write: bool = False) -> checkpoints_lib.Checkpoints:
        """RUN/checkpoints: to read, or (`write`, for the holder of the run's lock) to save and restore,
        keeping `keep` checkpoints, saving asynchronously if `async_save`."""
        return checkpoints_lib.Checkpoints(self, keep, async_save, write=write)

    def load_params(self, step: int | None = None) -> tuple[dict, int]:
        """(params, step) of a checkpoint, the last one by default: a pure dict of numpy arrays with
        integer block indices, as `nnx.to_pure_dict` gives them (orbax hands dict keys back as strings).
        For init_from, export, eval and sampling. A LoRA run's are its base's with the adapters merged in."""
        params, step, _ = self.load_weights(step)
        return params, step

    def load_adapters(self, step: int | None = None) -> tuple[dict, int]:
        """(adapters, step) of a LoRA run's checkpoint, the last by default: its `lora_a` and `lora_b` leaves
        as load_params gives parameters (lora.split's tree), not merged into any base; the base they
        were trained on must be there, as for load_params (load_lora_base), or a RunError names it."""
        cfg = self.config()
        if cfg.training.lora is None:
            raise RunError(f"{self} is not a LoRA run (its training.lora is null), so it has no adapters")
        params, step, _ = self.load_weights(step, adapters_only=True)
        load_lora_base(self.lora_base().get("init_from") or cfg.training.init_from, self)  # the base they adapt
        return params, step

    def load_weights(self, step: int | None = None, adapters_only: bool = False) -> tuple[dict, int, str]:
        """(params, step, fingerprint) as load_params, with a fingerprint of the parameters: the sha256 of
        the checkpoint's saved array fingerprints (which the load checked the arrays against); for a LoRA
        run, of its base's fingerprint, its adapters' and their shape (rank, alpha, targets). A LoRA run's
        params are its adapters alone with `adapters_only` (and the fingerprint theirs)."""
        import hashlib

        import numpy as np

        with self.checkpoints() as saved:
            state, step = saved.load(step)
            # a format 1 checkpoint saved none: those of what it holds, the numbers a save would have kept
            saved_fingerprints = saved.saved_fingerprints(step) or checkpoints_lib.fingerprints(state)

        def numpy_tree(tree):
            if not isinstance(tree, dict):
                return np.asarray(tree)
            return {int(k) if isinstance(k, str) and k.isdigit() else k: numpy_tree(v) for k, v in tree.items()}

        def sha256(obj) -> str:
            return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()

        params = numpy_tree(state["params"])
        fingerprint = sha256({k: v for k, v in saved_fingerprints.items() if k.startswith("params/")})
        cfg = self.config() if self.is_file(CONFIG) else None
        lora = cfg.training.lora if cfg is not None else None
        if lora is None or adapters_only:
            return params, step, fingerprint
        import lora as lora_lib
        import model as model_lib

        base, record = load_lora_base(self.lora_base().get("init_from") or cfg.training.init_from, self)
        merged = lora_lib.merge(lora_lib.join(base, params), model_lib.adapted_kernels(cfg.model, lora))
        shape = {k: getattr(lora, k) for k in lora.SHAPE_FIELDS}
        return numpy_tree(merged), step, sha256({"base": record["fingerprint"], "adapters": fingerprint, "lora": shape})

    def lora_base(self) -> dict:
        """lora_base.json: {init_from, step, fingerprint} of a LoRA run's frozen base ({} without one)."""
        record = self._json_object(LORA_BASE)
        if record is None:
            return {}
        if not (isinstance(record.get("fingerprint"), str)
                and isinstance(record.get("init_from"), str) and isinstance(record.get("step"), int)):
            raise RunError(f"{self.show(LORA_BASE)} does not record a base (init_from, step and fingerprint)")
        return record

    def save_lora_base(self, record: dict) -> None:
        self.write_text(LORA_BASE, json.dumps(record, indent=2) + "\n")

    def save_params(self, params: dict, step: int = 0) -> None:
        """A checkpoint holding only parameters (an import), saved at once: what init_from, eval, sample
        and export read."""
        import jax
        import numpy as np

        state = {"params": jax.tree.map(np.asarray, params), "step": np.asarray(step, np.int32)}
        with self.checkpoints(write=True) as saver:
            saver.save(step, state)

    def load_model(self, step: int | None = None, attention: str | None = None):
        """(the run's model.GPT with the checkpoint's parameters, the checkpoint step). `attention`: the
        implementation to run it with instead of its config's (attention.attention_here chooses one that runs
        on this machine); the parameters do not depend on it."""
        import dataclasses

        import jax
        import jax.numpy as jnp
        from flax import nnx

        from model import GPT

        cfg = self.config().model
        if attention is not None:
            cfg = dataclasses.replace(cfg, attention=attention)
        params, step = self.load_params(step)
        abstract = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(params=0)))  # shapes only, nothing computed
        graphdef, state = nnx.split(abstract)
        try:
            nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
        except (KeyError, ValueError) as e:
            raise RunError(f"checkpoint {step} of {self} does not fit its config.yaml: {e}") from None
        return nnx.merge(graphdef, state), step


def check_wandb(cfg: config_lib.Config) -> None:
    """wandb.mode=online needs a W&B login (an API key from `wandb login` or WANDB_API_KEY), checked
    without reaching the server; without a terminal to ask on, a missing one is a RunError."""
    if cfg.wandb.mode != "online":
        return
    import wandb

    try:
        found = wandb.login(verify=False)  # False: no key, and none given at a prompt
    except Exception:  # wandb's UsageError (no key, no terminal), or whatever its settings raise
        found = False
    if not found:
        raise RunError("wandb.mode=online needs a W&B login: run `wandb login` (or set WANDB_API_KEY) first, "
                       "or log with wandb.mode=offline and upload later with `wandb sync`") from None


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


def new_config(path, overrides: typing.Sequence[str]) -> config_lib.Config:
    """The config of a new run: the config file `path` with the overrides; fine-tuning (training.init_from)
    without `model=NAME` takes init_from's model, the command line's model.FIELD=VALUE on top."""
    cfg = config_lib.load_config(path, overrides)
    if cfg.training.init_from and not config_lib.names_model(overrides):
        cfg = config_lib.load_config(path, overrides, model=init_model(cfg.training.init_from))
    return cfg


def init_model(location) -> dict:
    """training.init_from's model section (its name and every field): a fine-tuning run's model unless
    the command line names one (`model=NAME`)."""
    try:
        return config_lib.to_dict(open_run(location).config())["model"]
    except UserError as e:
        raise RunError(f"training.init_from: {e}") from None


def check_init_from(location, mcfg, index: dict) -> None:
    """training.init_from: a run directory with a checkpoint, this run's model and the tokenizer the data
    (its `index`) was prepared with, or a RunError (one line)."""
    try:
        src = open_run(location)
        src_model = src.config().model
        has_checkpoint = bool(src.checkpoints().steps())
        src_tokenizer = src.tokenizer_sha256()
    except UserError as e:
        raise RunError(f"training.init_from: {e}") from None
    if not has_checkpoint:
        raise RunError(f"training.init_from={location}: no checkpoint in it to start from")
    if src_tokenizer is None:
        raise RunError(f"training.init_from={location} has no {TOKENIZER}, so the data cannot be checked against "
                       f"the model's tokenizer: copy the model's {TOKENIZER} into it (the one the data was "
                       f"prepared with)")
    if src_tokenizer != index.get("tokenizer_sha256"):
        raise RunError(f"training.init_from={location}: the data was tokenized with another tokenizer than its "
                       f"{TOKENIZER}; prepare the data with it (python data.py --tokenizer {location} ...)")
    # an ALiBi model may change its context: only the parameters' fields must agree
    diffs = [f"{f} {getattr(src_model, f)} there, {getattr(mcfg, f)} here" for f in mcfg.PARAMETER_FIELDS
             if getattr(src_model, f) != getattr(mcfg, f) and not (f == "block_size" and mcfg.max_length is None)]
    if diffs:
        raise RunError(f"training.init_from={location}: its model differs from this run's ({'; '.join(diffs)}); "
                       f"set the same model (and prepare the data with its tokenizer)")


def base_location(location) -> str:
    """training.init_from as lora_base.json records it: a local path made absolute (so that sample.py and
    eval.py find the base from any directory), a URL as it is."""
    location = storage.local_path(str(location))
    return location if storage.is_url(location) else os.path.abspath(location)


def load_lora_base(location, run: Run | None = None) -> tuple[dict, dict]:
    """(params, record) of a LoRA run's frozen base at training.init_from `location`: its parameters (numpy,
    float32) and the record lora_base.json keeps of it, {init_from, step, fingerprint}. With `run` (the LoRA
    run: a resume, or a reader of its model), the base must be the one the run records: at the recorded
    location, the recorded checkpoint step is loaded; anywhere, its fingerprint must be the recorded one.
    Otherwise a RunError in one line naming both."""
    recorded = run.lora_base() if run is not None else {}
    if run is not None and not recorded:
        raise RunError(f"{run} is a LoRA run but has no {LORA_BASE}, so the base its adapters belong to is "
                       f"unknown; it cannot be checked nor loaded")
    where = base_location(location)
    step = recorded.get("step") if recorded.get("init_from") == where else None
    try:
        params, step, fingerprint = open_run(location).load_weights(step)
    except UserError as e:
        raise RunError(f"the base model (training.init_from={location}) of this LoRA run: {e}") from None
    record = {"init_from": where, "step": step, "fingerprint": fingerprint}
    if recorded and recorded["fingerprint"] != fingerprint:
        raise RunError(f"training.init_from={location} (checkpoint {step}, fingerprint {fingerprint[:16]}) is not "
                       f"the base this LoRA run's adapters were trained on: {run.show(LORA_BASE)} records "
                       f"{recorded['init_from']} checkpoint {recorded['step']} (fingerprint "
                       f"{recorded['fingerprint'][:16]}); point training.init_from at that base")
    return params, record


def load_init_params(location, shardings):
    """training.init_from: the parameters of a run directory's last checkpoint, placed with `shardings`."""
    import jax

    try:
        params, _ = open_run(location).load_params()
    except UserError as e:
        raise RunError(f"training.init_from: {e}") from None
    return jax.device_put(params, shardings)


def _non_finite(value, path: str) -> str | None:
    """The path (section.key.index...) of the first NaN or infinity in a results value, or None."""
    import math

    if isinstance(value, float) and not math.isfinite(value):
        return path
    if isinstance(value, dict):
        return next((p for k, v in value.items() if (p := _non_finite(v, f"{path}.{k}"))), None)
    if isinstance(value, (list, tuple)):
        return next((p for i, v in enumerate(value) if (p := _non_finite(v, f"{path}.{i}"))), None)
    return None
