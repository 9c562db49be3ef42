"""The weights a run directory holds, for every reader: its parameters, a LoRA run's adapters and its
frozen base, and the model built from them.

    RUN/lora_base.json      a LoRA run's frozen base: training.init_from, its checkpoint step, a fingerprint

`Weights` is rundir.Run's `weights`: `load_params` (init_from, export, eval, sampling), `load_adapters`
(the PEFT export), `load_model`, `save_params` (an import). A LoRA run checkpoints its adapters only;
`load_params` gives its merged model (the base that lora_base.json names, checked to be the same
weights, with the adapters folded in: lora.merge), so the readers need not know LoRA. It is given what
it needs when it is made: the run's directory, its record (for the config) and its checkpoints (the run's
one owner of them); `Weights.at(location)` makes those parts for another run's weights, a LoRA run's base.
"""
from __future__ import annotations

import json
import os

from core import storage
from core.errors import RunError, UserError
from store import checkpoints as checkpoints_lib
from store import fingerprints
from store.record import Record

LORA_BASE = "lora_base.json"


class Weights:
    """The weights of a run directory (see the module docstring)."""

    def __init__(self, directory: storage.RunDir, record: Record, checkpoints: checkpoints_lib.RunCheckpoints,
                 base=None):
        self.dir, self.record, self.checkpoints = directory, record, checkpoints
        self.base = base  # where a LoRA run's base is now, if it moved (the readers' --base); else where it records
        self.point_at = "--base DIR"  # how a reader of a LoRA run whose base moved gives its new place

    @classmethod
    def at(cls, location) -> Weights:
        """The weights of the run directory at `location`, with a record and checkpoints of its own."""
        directory = storage.RunDir(location)
        return cls(directory, Record(directory), checkpoints_lib.RunCheckpoints(directory))

    def __str__(self) -> str:
        return str(self.dir)

    def load_params(self, step: int | None = None) -> tuple[dict, int]:
        """(params, step) of a checkpoint, the last one by default: a pure dict of numpy arrays with
        integer block indices, as `nnx.to_pure_dict` gives them (orbax hands dict keys back as strings).
        For init_from, export, eval and sampling. A LoRA run's are its base's with the adapters merged in."""
        params, step, _ = self.load_weights(step)
        return params, step

    def load_adapters(self, step: int | None = None) -> tuple[dict, int]:
        """(adapters, step) of a LoRA run's checkpoint, the last by default: its `lora_a` and `lora_b` leaves
        as load_params gives parameters (lora.split's tree), not merged into any base; the base they
        were trained on must be there, as for load_params (frozen_base), or a RunError names it."""
        cfg = self.record.config()
        if cfg.training.lora is None:
            raise RunError(f"{self} is not a LoRA run (its training.lora is null), so it has no adapters")
        params, step, _ = self.load_weights(step, adapters_only=True)
        self.frozen_base(self.base_location())  # the base they adapt
        return params, step

    def base_location(self) -> str:
        """Where a LoRA run's base is read from: `base` when given (it moved), else where lora_base.json
        records it (or the config's training.init_from, for a run without one)."""
        return self.base or self.lora_base().get("init_from") or self.record.config().training.init_from

    def load_weights(self, step: int | None = None, adapters_only: bool = False) -> tuple[dict, int, str]:
        """(params, step, fingerprint) as load_params, with a fingerprint of the parameters: the sha256 of
        the checkpoint's saved array fingerprints (which the load checked the arrays against); for a LoRA
        run, of its base's fingerprint, its adapters' and their shape (rank, alpha, targets). A LoRA run's
        params are its adapters alone with `adapters_only` (and the fingerprint theirs)."""
        import hashlib

        import numpy as np

        with self.checkpoints.read() as saved:
            state, step = saved.load(step)
            # a format 1 checkpoint saved none: those of what it holds, the numbers a save would have kept
            saved_fingerprints = saved.saved_fingerprints(step) or fingerprints.fingerprints(state)

        def numpy_tree(tree):
            if not isinstance(tree, dict):
                return np.asarray(tree)
            return {int(k) if isinstance(k, str) and k.isdigit() else k: numpy_tree(v) for k, v in tree.items()}

        def sha256(obj) -> str:
            return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()

        params = numpy_tree(state["params"])
        fingerprint = sha256({k: v for k, v in saved_fingerprints.items() if k.startswith("params/")})
        cfg = self.record.config() if self.record.has_config() else None
        lora = cfg.training.lora if cfg is not None else None
        if lora is None or adapters_only:
            return params, step, fingerprint
        import model as model_lib
        from layers import lora as lora_lib

        base, record = self.frozen_base(self.base_location())
        merged = lora_lib.merge(lora_lib.join(base, params), model_lib.adapted_kernels(cfg.model, lora))
        shape = {k: getattr(lora, k) for k in lora.SHAPE_FIELDS}
        return numpy_tree(merged), step, sha256({"base": record["fingerprint"], "adapters": fingerprint, "lora": shape})

    def lora_base(self) -> dict:
        """lora_base.json: {init_from, step, fingerprint} of a LoRA run's frozen base ({} without one)."""
        record = self.dir.json_object(LORA_BASE)
        if record is None:
            return {}
        if not (isinstance(record.get("fingerprint"), str)
                and isinstance(record.get("init_from"), str) and isinstance(record.get("step"), int)):
            raise RunError(f"{self.dir.show(LORA_BASE)} does not record a base (init_from, step and fingerprint)")
        return record

    def save_lora_base(self, record: dict) -> None:
        self.dir.write_text(LORA_BASE, json.dumps(record, indent=2) + "\n")

    def save_params(self, params: dict, step: int = 0) -> None:
        """A checkpoint holding only parameters (an import), saved at once: what init_from, eval, sample
        and export read."""
        import jax
        import numpy as np

        state = {"params": jax.tree.map(np.asarray, params), "step": np.asarray(step, np.int32)}
        with self.checkpoints.write() as saver:
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

        cfg = self.record.config().model
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

    def frozen_base(self, location, check: bool = True, point_at: str | None = None) -> tuple[dict, dict]:
        """(params, record) of this LoRA run's frozen base at training.init_from `location`: its parameters
        (numpy, float32) and the record lora_base.json keeps of it, {init_from, step, fingerprint}. With
        `check` (a resume, or a reader of its model), the base must be the one the run records: at the
        recorded location, the recorded checkpoint step is loaded; anywhere, its fingerprint must be the
        recorded one. Otherwise a RunError in one line naming both, and how to give the base's place
        (`point_at`: the readers' --base, a resume's training.init_from). Without (a new run), it is the base."""
        point_at = point_at or self.point_at
        recorded = self.lora_base() if check else {}
        if check and not recorded:
            raise RunError(f"{self} is a LoRA run but has no {LORA_BASE}, so the base its adapters belong to is "
                           f"unknown; it cannot be checked nor loaded")
        where = base_location(location)
        given = f"--base {location}" if self.base is not None and location == self.base else \
            f"training.init_from={location}"
        step = recorded.get("step") if recorded.get("init_from") == where else None
        try:
            params, step, fingerprint = Weights.at(location).load_weights(step)
        except UserError as e:
            raise RunError(f"the base model ({given}) of this LoRA run: {e}; if the base moved, "
                           f"give its new place: {point_at}") from None
        record = {"init_from": where, "step": step, "fingerprint": fingerprint}
        if recorded and recorded["fingerprint"] != fingerprint:
            raise RunError(f"{given} (checkpoint {step}, fingerprint {fingerprint[:16]}) is "
                           f"not the base this LoRA run's adapters were trained on: {self.dir.show(LORA_BASE)} records "
                           f"{recorded['init_from']} checkpoint {recorded['step']} (fingerprint "
                           f"{recorded['fingerprint'][:16]}); give that base's place: {point_at}")
        return params, record


def base_location(location) -> str:
    """training.init_from as lora_base.json records it: a local path made absolute (so that sample.py and
    eval.py find the base from any directory), a URL as it is."""
    location = storage.local_path(str(location))
    return location if storage.is_url(location) else os.path.abspath(location)
