"""What a run is, as its directory records it: the effective config with the rules of a resume, the
format the run was written in, and the data it trained on.

    RUN/config.yaml      the effective config (config.py's dataclasses, the model fully resolved)
    RUN/format.json      the format the run was last written in (formats.py; none before format 3)
    RUN/data.json        the data it trained on: dir, index, tokenizer and its sha256, vocab_size, kind, and
                         the content's fingerprint (and at a URL each file's version)
    RUN/tokenizer.json   a copy of the data's tokenizer, so the run decodes without the corpus

`Record` is rundir.Run's `record`; weights.py reads a run's config through it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import typing

import yaml

from core import storage
from core.errors import RunError
from store import formats
from tokendata import shards
from training import config as config_lib

CONFIG = "config.yaml"
DATA = "data.json"
TOKENIZER = "tokenizer.json"


class Record:
    """What a run is: its effective config (config.yaml) with the rules of a resume, the format it was
    written in (format.json), the data it trained on (data.json, tokenizer.json) and the checks of both
    against what a resume is given. It reads and writes through the run's `directory` (a storage.RunDir)."""

    def __init__(self, directory: storage.RunDir):
        self.dir = directory

    def __str__(self) -> str:
        return str(self.dir)

    # ------------------------------------------------------------------------------------------
    # config.yaml

    def has_config(self) -> bool:
        return self.dir.is_file(CONFIG)

    def config(self, overrides: typing.Sequence[str] = ()) -> config_lib.Config:
        """The run's effective config (with `overrides`), for resume, eval, sample and convert; a run
        written in a format newer than this code reads is a RunError naming the version that reads it."""
        if not self.dir.is_file(CONFIG):
            raise RunError(f"{self} is not a run directory: {CONFIG} not found in it")
        self.check_format()
        text = self.dir.read_bytes(CONFIG)
        raw = config_lib.apply_overrides(config_lib.parse_yaml(text, self.dir.show(CONFIG)), overrides)
        return config_lib.from_saved(raw)  # the model as saved, whatever conf/model_config.yaml says now

    def resume_config(self, overrides: typing.Sequence[str]) -> config_lib.Config:
        """config(overrides) for --resume, which continues the run's own model: an override that names a
        model (`model=NAME`) or changes what its parameters are (a GPTConfig.PARAMETER_FIELDS field; an
        ALiBi model's block_size aside, which only bounds its context) is a RunError in one line. How the
        model runs (model.remat, dtype, attention, dropout) may change."""
        saved = self.config()
        # `model=NAME` of the run's own model is the command that started it, repeated: nothing to change
        overrides = [o for o in overrides if not (o.partition("=")[0].strip() == "model"
                                                  and o.partition("=")[2].strip() == saved.model_name)]
        named = [o for o in overrides if o.partition("=")[0].strip() == "model"]
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
        if saved.training.optimizer != cfg.training.optimizer and cfg.training.lora is None:  # (LoRA: AdamW's always)
            raise RunError(f"--resume cannot change training.optimizer ({saved.training.optimizer} -> "
                           f"{cfg.training.optimizer}): its checkpoints hold {saved.training.optimizer}'s state; start a "
                           f"new run (training.init_from={self} starts from these weights with a fresh optimizer)")
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

        def every_key(c):  # the optional data keys too (a saved config leaves them out when unset): [] -> [...]
            return {**config_lib.to_dict(c), "data": dataclasses.asdict(c.data)}

        was, now = dict(flat(every_key(saved))), dict(flat(every_key(cfg)))
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

    def save_config(self, cfg: config_lib.Config, step: int = 0) -> str:
        """Write config.yaml at once (a crash never leaves half a config), and format.json: the run is
        written in this code's format from now on (a resumed older run included: its checkpoints after
        `step`, the step it resumes at). Returns how the config is named."""
        header = "# The effective config of this run (written by train.py); `python train.py --resume` reads it.\n"
        try:
            recorded = self.dir.json_object(formats.FILE)
        except RunError:  # damaged: written anew
            recorded = None
        self.dir.write_text(formats.FILE, json.dumps(formats.run_record(step, recorded)) + "\n")
        self.dir.write_text(CONFIG, header + yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False))
        return self.dir.show(CONFIG)

    def check_format(self) -> None:
        """A RunError (one line) when the run directory is in a format newer than this code reads, or its
        format.json is damaged. A run from before format 3 has none: every older format is read."""
        recorded = self.dir.json_object(formats.FILE)
        if recorded is None:
            return
        newer = formats.too_new(f"run directory {self}", recorded)
        if newer:
            raise RunError(newer)
        number = recorded.get("format")
        if not isinstance(number, int) or isinstance(number, bool) or number < formats.FIRST_RECORDED:
            raise RunError(f"{self.dir.show(formats.FILE)} records no format this project has written (an integer from "
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
        self.dir.write_text(DATA, json.dumps(ref, indent=2) + "\n")
        self.dir.write_bytes(TOKENIZER, data.tokenizer_json)

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
            raise RunError(f"{start} was tokenized with another tokenizer than this run's ({self.dir.show(TOKENIZER)}); {fix}")
        if "content_sha256" in recorded and not (isinstance(recorded["content_sha256"], str)
                                                 and re.fullmatch(r"[0-9a-f]{64}", recorded["content_sha256"])
                                                 and recorded["content_sha256"].strip("0")):
            raise RunError(f"{self.dir.show(DATA)} records a damaged fingerprint of the data (content_sha256 "
                           f"{recorded['content_sha256']!r}): {start} cannot be checked against what the run trained "
                           f"on; restore data.json, or start a new run from it (training.init_from={self})")
        if recorded.get("content_sha256"):
            if recorded["content_sha256"] != shards.content_sha256(data.index):
                raise RunError(f"{start} is not the data this run trained on: its content differs from what "
                               f"{self.dir.show(DATA)} records (prepared again, or other data); {fix}")
        elif not recorded.get("tokenizer_sha256") and ours is None:
            raise RunError(f"{self.dir.show(DATA)} records no fingerprint of the data and {self} has no {TOKENIZER}: "
                           f"{start} cannot be checked against what the run trained on; start a new run from it "
                           f"(training.init_from={self})")
        elif recorded.get("tokenizer_sha256") and recorded["tokenizer_sha256"] != data.tokenizer_sha256:
            raise RunError(f"{start} was tokenized with another tokenizer than the one {self.dir.show(DATA)} records; {fix}")
        check_samples(data, start, fix)
        if str(recorded.get("dir")).rstrip("/") != str(data) or not isinstance(recorded.get("versions"), dict):
            return
        now = data.versions or {}
        changed = sorted(name for name, version in recorded["versions"].items() if now.get(name) != version)
        if changed:
            raise RunError(f"{start} changed since this run started: {changed[0]}"
                           + (f" and {len(changed) - 1} more files differ" if len(changed) > 1 else " differs")
                           + f" from the versions {self.dir.show(DATA)} records; {fix}")

    def save_mixture(self, sources: dict[str, shards.DataDir], shares: list[dict]) -> None:
        """Record the prepared directories a mixture run trains on, by source name (each as save_data
        records one), the effective shares of each stage (`shares`: [{step, shares: {name: share}}]), and
        copy their tokenizer (one for all, check_sources made sure)."""
        first = next(iter(sources.values()))
        ref = {
            "mixture": {name: {"dir": str(data), "index": data.show("index.json"),
                               "content_sha256": shards.content_sha256(data.index),
                               **({"versions": data.versions} if data.remote else {})}
                        for name, data in sources.items()},
            "stages": shares,
            "tokenizer_sha256": first.tokenizer_sha256,
            "vocab_size": first.vocab_size,
            "kind": first.kind,
        }
        self.dir.write_text(DATA, json.dumps(ref, indent=2) + "\n")
        self.dir.write_bytes(TOKENIZER, first.tokenizer_json)

    def check_mixture(self, sources: dict[str, shards.DataDir]) -> None:
        """A resume of a mixture run trains on the sources it started with, by name, wherever each now
        lies: a RunError (one line) for a source added or removed, or one whose content (or, at a URL, a
        file's version) differs from what data.json records."""
        recorded = self.data().get("mixture")
        if not isinstance(recorded, dict):
            raise RunError(f"data.mixture: {self} trained on one directory ({self.data().get('dir')}), not a "
                           f"mixture; a resume trains on the data it started with (start a new run from it: "
                           f"training.init_from={self})")
        if list(recorded) != list(sources):
            raise RunError(f"data.mixture: this run mixes {', '.join(recorded)} (in that order); a resume cannot "
                           f"add, remove or reorder sources (given: {', '.join(sources)}); start a new run from it "
                           f"(training.init_from={self})")
        for name, data in sources.items():
            was = recorded[name]
            if not isinstance(was, dict) or was.get("content_sha256") != shards.content_sha256(data.index):
                raise RunError(f"data.mixture.{name}.dir {data} is not the data this run trained on as {name!r}: "
                               f"its content differs from what {self.dir.show(DATA)} records (prepared again, or "
                               f"other data); point it at {was.get('dir') if isinstance(was, dict) else 'that data'}")
            check_samples(data, f"data.mixture.{name}.dir {data}", "point it at the data this run trained on")
            if was.get("dir") == str(data) and isinstance(was.get("versions"), dict):
                now = data.versions or {}
                changed = sorted(f for f, v in was["versions"].items() if now.get(f) != v)
                if changed:
                    raise RunError(f"data.mixture.{name}.dir {data} changed since this run started: {changed[0]} "
                                   f"differs from the version {self.dir.show(DATA)} records")

    def tokenizer_sha256(self) -> str | None:
        """The sha256 of the run's tokenizer.json, None without one."""
        return hashlib.sha256(self.dir.read_bytes(TOKENIZER)).hexdigest() if self.dir.is_file(TOKENIZER) else None

    def data(self) -> dict:
        """data.json ({} for a run without one, e.g. an import)."""
        return self.dir.json_object(DATA) or {}

    def is_finetuned(self) -> bool:
        """Whether the run trained on prompt/completion pairs (or preference pairs: responses to prompts too)."""
        return shards.is_prompt_completion(self.data()) or shards.is_preference(self.data())

    def tokenizer_json(self) -> bytes:
        """The bytes of the run's tokenizer.json, checked against the sha256 data.json records (a run from
        before data.json recorded one, or an import, has nothing to check it against): another file in its
        place would decode every token wrongly, and an export would carry it."""
        if not self.dir.is_file(TOKENIZER):
            raise RunError(f"{self} has no {TOKENIZER}")
        raw = self.dir.read_bytes(TOKENIZER)
        recorded = self.data().get("tokenizer_sha256")
        if isinstance(recorded, str) and hashlib.sha256(raw).hexdigest() != recorded:
            where = self.data().get("tokenizer") or self.data().get("dir")
            raise RunError(f"{self.dir.show(TOKENIZER)} is not the tokenizer this run trained with: its sha256 is "
                           f"{hashlib.sha256(raw).hexdigest()[:16]}..., {self.dir.show(DATA)} records "
                           f"{recorded[:16]}...; put the run's own back" + (f" (the data's copy: {where})" if where else ""))
        return raw

    def tokenizer(self):
        """The run's tokenizers.Tokenizer (its tokenizer.json, checked: tokenizer_json)."""
        from tokenizers import Tokenizer

        raw = self.tokenizer_json()
        try:
            return Tokenizer.from_str(raw.decode())
        except Exception as e:  # a damaged file
            reason = storage.one_line(e)
            raise RunError(f"cannot load {self.dir.show(TOKENIZER)}: {reason}") from None


def check_samples(data: shards.DataDir, start: str, fix: str) -> None:
    """A RunError when a local shard's sampled blocks changed since preparation (shards.changed_samples)."""
    changed = shards.changed_samples(data)
    if changed:
        raise RunError(f"{start} changed since it was prepared: {changed[0]}"
                       + (f" and {len(changed) - 1} more shards" if len(changed) > 1 else "")
                       + f" no longer match the sample of their bytes index.json records (python data.py --verify "
                       f"{data} reads every byte); restore the data, or prepare it again and {fix}")
