"""The run directory: every file of a run, wherever it lives, and which part of `Run` owns each.

    RUN/config.yaml             the effective config (the model fully resolved)           run.record (record.py)
    RUN/format.json             the format the run was last written in (formats.py)        run.record
    RUN/data.json               the data it trained on                                     run.record
    RUN/tokenizer.json          a copy of the data's tokenizer                             run.record
    RUN/metrics.jsonl           one JSON object per logged step                            Run
    RUN/summary.json            where training ended                                       Run
    RUN/loss.png                the training and validation loss by step                   Run
    RUN/wandb_id.txt            the W&B run id: a resume and eval.py log into the same W&B run  Run
    RUN/eval/step<N>.json       eval.py's results for checkpoint N                         Run
    RUN/.lock                   who writes the run now: one writer at a time               run.lock (runlock.py)
    RUN/lora_base.json          a LoRA run's frozen base: init_from, its checkpoint step   run.weights (weights.py)
    RUN/checkpoints/            orbax checkpoints of the state, and                        run.checkpoints
    RUN/checkpoints-damaged/    damaged ones, moved aside                                  (checkpoints.py)

`Run` is made of parts, each given what it needs when it is made: `dir`, the run's files (a
storage.RunDir: a local path, or a URL such as gs://bucket/runs/x, whose files go through fsspec and whose
checkpoints orbax writes itself); `record` (what the run is, and the checks of a resume); `lock` (the
writer's lock or bucket lease); `checkpoints` (the one owner of their saving and reading); `weights` (the
parameters, a LoRA run's adapters and base, the model; given the record and the checkpoints); and here its
logs and eval.py's results. train.py writes a run; eval.py, sample.py and convert_torch.py read it through
`run.record.config()`, `run.record.tokenizer()`, `run.weights.load_model()` and `load_params()`;
convert_torch.py's import writes one with `run.weights.save_params()`.

A run directory a user points at that is not one, a checkpoint that cannot be read (its arrays,
its metadata) or that does not fit the model: a RunError, one line in the user's terms. Knows nothing
of how a model computes (model.py is read by weights.py, lazily).
"""
from __future__ import annotations

import datetime
import json
import pathlib
import typing

from core import json_log, storage
from core.errors import RunError, UserError
from store import checkpoints as checkpoints_lib
from store import runlock, weights
from store.record import CONFIG, TOKENIZER, Record
from training import config as config_lib

if typing.TYPE_CHECKING:
    from tokendata import shards

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
WANDB_ID = "wandb_id.txt"


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


class Run:
    """A run directory and the files in it (see the module docstring): its files (`dir`), what the run is
    (`record`), its writer's lock (`lock`), its checkpoints, its weights, and here its logs and eval.py's
    results. str() is its location as given."""

    LOSS_PLOT = "loss.png"

    def __init__(self, location, base=None):
        self.dir = storage.RunDir(location)
        self.record = Record(self.dir)
        self.lock = runlock.Lock(self.dir)
        self.checkpoints = checkpoints_lib.RunCheckpoints(self.dir)
        self.weights = weights.Weights(self.dir, self.record, self.checkpoints, base)  # base: a LoRA run's, moved

    def __str__(self) -> str:
        return str(self.dir)

    def writer(self, purpose: str, new: bool = False):
        """The run's lock held while writing it (runlock.Lock.writer); `new`: a new run starts here, which
        is checked (check_new) once the lock is held."""
        return self.lock.writer(purpose, check_new=self.check_new if new else None)

    def check_new(self) -> None:
        """A new run may start here: nothing is in the directory yet (but perhaps a lock)."""
        if not set(self.dir.names()) - {runlock.LOCK}:
            return
        holder = self.lock.held_by()
        if holder:
            raise RunError(f"run directory {self} is in use by {holder}; one process writes a run at a time "
                           f"(wait for it to end, or stop it first)")
        if self.dir.is_file(CONFIG) and not self.checkpoints.steps():
            raise RunError(f"run directory {self} holds a run stopped before its first checkpoint; continue it "
                           f"with --resume (from step 0, with its saved config), or remove the directory to start anew")
        raise RunError(f"run directory {self} already exists; continue it with --resume, "
                       f"or start a new run elsewhere with run_dir=PATH")

    # ------------------------------------------------------------------------------------------
    # Logs

    def metrics(self, start_step: int) -> json_log.JsonLines:
        """metrics.jsonl, continued after `start_step` (the rows of later steps are dropped)."""
        return json_log.JsonLines(self.dir, METRICS, keep=lambda row: row["step"] <= start_step)

    def tokens_per_step(self, cfg: config_lib.Config) -> int | None:
        """The tokens each step of this run has trained so far when its record fixes them: its config's (`cfg`,
        as last configured) batch x context, when every row of metrics.jsonl counts exactly its step x that
        (no resume changed the batch or the context). None when a row counts otherwise, or when the log has
        no row to tell by (lost, or unreadable): then nothing fixes them."""
        per_step = cfg.tokens_per_step
        try:
            text = self.dir.read_text(METRICS) if self.dir.is_file(METRICS) else ""
            rows = [row for row, _ in json_log.json_lines(text, METRICS)[0]]  # a last line cut off by a kill: left out
        except (UserError, OSError, UnicodeDecodeError):
            return None
        for row in rows:
            step, tokens = (row.get("step"), row.get("tokens")) if isinstance(row, dict) else (None, None)
            if not (isinstance(step, int) and isinstance(tokens, int)) or tokens != step * per_step:
                return None
        return per_step if rows else None

    def logged(self) -> list[dict]:
        """metrics.jsonl's rows, read (plot.py): each a logged step with its loss; a last line cut off (a stop
        during its write) left out. A RunError (one line) where there is none, or a row train.py never wrote."""
        if not self.dir.is_file(METRICS):
            raise RunError(f"{self} has no {METRICS}: not a run directory, or a run stopped before its first "
                           f"logged step")
        shown = self.dir.show(METRICS)
        try:
            text = self.dir.read_bytes(METRICS).decode()
        except UnicodeDecodeError as e:
            raise RunError(f"{shown} is not UTF-8 text (byte {e.start}): not a log train.py wrote") from None
        rows = [row for row, _ in json_log.json_lines(text, shown)[0]]
        for number, row in enumerate(rows, 1):
            if not (isinstance(row, dict) and isinstance(row.get("step"), int)
                    and isinstance(row.get("loss"), (int, float))):
                raise RunError(f"{shown}: line {number} is no logged step (a JSON object with a step and a loss)")
        if not rows:
            raise RunError(f"{shown} has no logged step yet")
        return rows

    def wandb_id(self, new: str | None = None) -> str | None:
        """The run's W&B id; when it has none and `new` is given, `new` becomes it."""
        if self.dir.is_file(WANDB_ID):
            return self.dir.read_text(WANDB_ID).strip()
        if new is not None:
            self.dir.write_text(WANDB_ID, new + "\n")
        return new

    def start_wandb(self, cfg: config_lib.Config):
        """The run's W&B run: a resume (and eval.py) continues the one whose id the run directory keeps."""
        import uuid

        import wandb

        return wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.wandb.name or self.dir.name,
                          id=self.wandb_id(new=uuid.uuid4().hex[:8]), resume="allow", mode=cfg.wandb.mode,
                          dir=None if self.dir.remote else str(self), config=config_lib.to_dict(cfg))

    def save_summary(self, summary: dict) -> None:
        self.dir.write_text(SUMMARY, json.dumps(summary, indent=2) + "\n")

    # ------------------------------------------------------------------------------------------
    # eval.py's results: RUN/eval/step<N>.json (eval_results_name), added to section by section

    def read_results(self, name: str) -> dict:
        """The JSON results file `name` ({} if there is none yet), checked to be one that eval.py can add to."""
        if not self.dir.is_file(name):
            return {}
        try:
            results = json.loads(self.dir.read_text(name))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            results, why = None, f"unreadable JSON ({e})"
        else:
            why = results_problem(results)
        if why:
            raise RunError(f"{self.dir.show(name)} is not an eval.py results file: {why}; move it away to evaluate "
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
        self.dir.write_text(name, json.dumps(results, indent=2) + "\n")
        return results[section]


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


def existing(location, base=None) -> Run:
    """A run directory to read (eval, sample, convert): a local one must exist; one at a URL is
    checked when its config is read. `base` (the readers' --base): where a LoRA run's base model is now,
    if it moved since training; a RunError for a run that is no LoRA run."""
    location = storage.local_path(location)  # file:///x: the local directory /x
    if not storage.is_url(location) and storage.link_loop(location):
        raise RunError(f"run directory {location}: {storage.LINK_LOOP}: mend or remove the link, or give the run "
                       f"directory itself")
    if not storage.is_url(location) and not pathlib.Path(location).is_dir():
        raise RunError(f"run directory {location} not found")
    run = Run(location, base)
    if base is not None and run.record.config().training.lora is None:
        raise RunError(f"--base {base}: {location} is not a LoRA run (its training.lora is null): its checkpoints hold "
                       f"its whole model, with no base to point at; leave --base out")
    return run


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
        return config_lib.to_dict(open_run(location).record.config())["model"]
    except UserError as e:
        raise RunError(f"training.init_from: {e}") from None


def check_init_from(location, mcfg, data: shards.DataDir, resume: bool = False) -> None:
    """training.init_from: a run directory with a checkpoint, this run's model and the tokenizer the data
    was prepared with, or a RunError (one line); for a `resume`, one that is not there (any more) is said
    with the override that gives its new place."""
    moved = "; if it moved since this run started, give its new place: --resume training.init_from=DIR" \
        if resume else ""
    try:
        src = open_run(location)
        src_model = src.record.config().model
        has_checkpoint = bool(src.checkpoints.steps())
        src_tokenizer = src.record.tokenizer_sha256()
    except UserError as e:
        raise RunError(f"training.init_from: {e}{moved}") from None
    if not has_checkpoint:
        raise RunError(f"training.init_from={location}: no checkpoint in it to start from{moved}")
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


def init_from_line(location) -> str:
    """What a new run starting from training.init_from's parameters says of them: where they come from, and
    of a LoRA run's, that they are its merged model (its base with the adapters folded in), which the run
    then trains whole, since this one sets no adapters of its own."""
    try:
        src = open_run(location)
        if src.record.config().training.lora is None:
            return f"parameters from {location}"
        base = src.weights.lora_base().get("init_from") or src.record.config().training.init_from
    except UserError as e:
        raise RunError(f"training.init_from: {e}") from None
    return (f"parameters from {location}, a LoRA run: its merged weights (its base {base} with the adapters folded "
            f"in), every one of them trained from here (a full fine-tune); to train an adapter on them instead, "
            f"set training.lora.rank (and the other training.lora.* keys)")


def load_init_params(location, shardings):
    """training.init_from: the parameters of a run directory's last checkpoint, placed with `shardings`."""
    import jax

    try:
        weights = open_run(location).weights
        # a LoRA run's base moved: nothing here can point at it (init_from names the LoRA run, not its base)
        weights.point_at = "move it back where the LoRA run records it, or start from that base itself"
        params, _ = weights.load_params()
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
