"""The run directory: every file of a run, wherever it lives, and who owns each.

    RUN/config.yaml             the effective config (config.py's dataclasses, the model fully resolved)  Record
    RUN/format.json             the format the run was last written in (formats.py; none before format 3) Record
    RUN/data.json               the data it trained on: dir, index, tokenizer and its sha256, vocab_size, kind
    RUN/tokenizer.json          a copy of the data's tokenizer, so the run decodes without the corpus     Record
    RUN/metrics.jsonl           one JSON object per logged step                                           Run
    RUN/summary.json            where training ended                                                      Run
    RUN/loss.png                the training and validation loss by step (drawn at each evaluation)       Run
    RUN/wandb_id.txt            the W&B run id: a resume and eval.py log into the same W&B run            Run
    RUN/eval/step<N>.json       eval.py's results for checkpoint N                                        Run
    RUN/.lock                   who writes the run now: one writer at a time              runlock.Locked
    RUN/lora_base.json          a LoRA run's frozen base: init_from, its checkpoint step  weights.Weights
    RUN/checkpoints/            orbax checkpoints of the state, and                       checkpoints.py
    RUN/checkpoints-damaged/    damaged ones, moved aside

`Run` is a storage.RunDir (a local path, or a URL such as gs://bucket/runs/x, whose files go through
fsspec and whose checkpoints orbax writes itself) made of parts that can each be read alone: `Record`
(what the run is, and the checks of a resume), weights.Weights (its parameters, a LoRA run's adapters
and base, the model), runlock.Locked (the writer's lock or bucket lease), and its own logs and results.
train.py writes a run; eval.py, sample.py and convert_torch.py read it through `Run.config`,
`Run.load_model`, `Run.load_params` and `Run.tokenizer`; convert_torch.py's import writes one with
`Run.save_params`. Every checkpoint is saved, restored and loaded through one owner, `Run.checkpoints()`,
a checkpoints.Checkpoints to read or a checkpoints.Saver to write.

A run directory a user points at that is not one, a checkpoint that cannot be read (its arrays,
its metadata) or that does not fit the model: a RunError, one line in the user's terms. Knows nothing
of how a model computes (model.py is read by weights.py, lazily).
"""
from __future__ import annotations

import datetime
import json
import pathlib
import typing

import yaml

from core import storage
from core.errors import RunError, UserError
from store import checkpoints as checkpoints_lib
from store import formats, runlock, weights
from tokendata import shards
from training import config as config_lib

CONFIG = "config.yaml"
DATA = "data.json"
TOKENIZER = "tokenizer.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
WANDB_ID = "wandb_id.txt"
LORA_BASE = weights.LORA_BASE
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


class Record(storage.RunDir):
    """What a run is: its effective config (config.yaml) with the rules of a resume, the format it was
    written in (format.json), the data it trained on (data.json, tokenizer.json) and the checks of both
    against what a resume is given."""

    # ------------------------------------------------------------------------------------------
    # config.yaml

    def has_config(self) -> bool:
        return self.is_file(CONFIG)

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
        recorded = self.json_object(formats.FILE)
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

    # ------------------------------------------------------------------------------------------
    # The data: data.json and tokenizer.json

    def save_data(self, data: shards.DataDir) -> None:
        """Record the prepared data the run trains on (its location as the config holds it: a URL or a
        resolved path), with the object store's version of each of its files for a URL, and copy its
        tokenizer."""
        ref = {
            "dir": str(data),
            "index": data.show("index.json"),
            "tokenizer": data.show(data.index["tokenizer"]),
            "tokenizer_sha256": data.tokenizer_sha256,
            "vocab_size": data.vocab_size,
            "kind": data.kind,  # prompt_completion: sample.py completes prompts like training
            "content_sha256": shards.content_sha256(data.index),  # what check_data compares at a resume, anywhere
        }
        if data.remote:  # what check_data compares at a resume
            ref["versions"] = data.versions
        self.write_text(DATA, json.dumps(ref, indent=2) + "\n")
        self.write_bytes(TOKENIZER, data.tokenizer_json)

    def check_data(self, data: shards.DataDir) -> None:
        """A resume trains on the data it started with, wherever it now lies: a RunError (one line) when
        the data's tokenizer is not the run's tokenizer.json, when its content (shards.content_sha256: the
        tokenizer, every shard's size and sha256) differs from what data.json records (prepared again,
        or `data.dir` pointed elsewhere), and at a URL when a file's object-store version changed. A run
        whose data.json records no fingerprint (an older version's) has its tokenizer compared with
        the recorded one's sha256; one that records neither cannot be checked, and is refused."""
        recorded = self.data()
        if not recorded:
            return  # an import: nothing trained yet, nothing to compare
        start = f"data.dir {data}"
        fix = (f"resume on the data it trained on ({recorded.get('dir')}), or start a new run from it "
               f"(training.init_from={self})")
        ours = self.tokenizer_sha256()
        if ours is not None and ours != data.tokenizer_sha256:
            raise RunError(f"{start} was tokenized with another tokenizer than this run's ({self.show(TOKENIZER)}); {fix}")
        if recorded.get("content_sha256"):
            if recorded["content_sha256"] != shards.content_sha256(data.index):
                raise RunError(f"{start} is not the data this run trained on: its content differs from what "
                               f"{self.show(DATA)} records (prepared again, or other data); {fix}")
        elif not recorded.get("tokenizer_sha256") and ours is None:
            raise RunError(f"{self.show(DATA)} records no fingerprint of the data and {self} has no {TOKENIZER}: "
                           f"{start} cannot be checked against what the run trained on; start a new run from it "
                           f"(training.init_from={self})")
        elif recorded.get("tokenizer_sha256") and recorded["tokenizer_sha256"] != data.tokenizer_sha256:
            raise RunError(f"{start} was tokenized with another tokenizer than the one {self.show(DATA)} records; {fix}")
        if str(recorded.get("dir")).rstrip("/") != str(data) or not isinstance(recorded.get("versions"), dict):
            return
        now = data.versions or {}
        changed = sorted(name for name, version in recorded["versions"].items() if now.get(name) != version)
        if changed:
            raise RunError(f"{start} changed since this run started: {changed[0]}"
                           + (f" and {len(changed) - 1} more files differ" if len(changed) > 1 else " differs")
                           + f" from the versions {self.show(DATA)} records; {fix}")

    def tokenizer_sha256(self) -> str | None:
        """The sha256 of the run's tokenizer.json, None without one."""
        import hashlib

        return hashlib.sha256(self.read_bytes(TOKENIZER)).hexdigest() if self.is_file(TOKENIZER) else None

    def json_object(self, name: str) -> dict | None:
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
        return self.json_object(DATA) or {}

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

class Run(Record, weights.Weights, runlock.Locked):
    """A run directory and the files in it (see the module docstring): what the run is (Record), its
    weights (weights.Weights), its writer's lock (runlock.Locked), and here its logs, eval.py's results and
    the owner of its checkpoints."""

    LOSS_PLOT = "loss.png"

    def check_new(self) -> None:
        """A new run may start here: nothing is in the directory yet (but perhaps a lock)."""
        if not set(self.names()) - {runlock.LOCK}:
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
        return checkpoints_lib.Saver(self, keep, async_save) if write else checkpoints_lib.Checkpoints(self)


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


def check_init_from(location, mcfg, data: shards.DataDir) -> None:
    """training.init_from: a run directory with a checkpoint, this run's model and the tokenizer the data
    was prepared with, or a RunError (one line)."""
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
    if src_tokenizer != data.tokenizer_sha256:
        raise RunError(f"training.init_from={location}: the data was tokenized with another tokenizer than its "
                       f"{TOKENIZER}; prepare the data with it (python data.py --tokenizer {location} ...)")
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
