"""A run directory and what it holds: one entry, `rundir.Run`, made of its record (config, format, data),
its writer's lock (runlock.py), its weights (weights.py) and its checkpoints (checkpoints.py, with
fingerprints.py and formats.py). It imports training/ (the config, several processes), model.py, layers/,
tokendata/ and core/."""
