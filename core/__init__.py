"""What every other layer stands on: the user-error classes and the one runner every command line goes
through (errors.py), bytes at local paths or URLs (storage.py), a run's JSON Lines log (json_log.py),
the memory this process may use (machine.py), an output directory written whole and swapped into place
(outputs.py), chat templates (chat.py), typed values read from YAML (typed_config.py) and JAX keys from
64-bit seeds (seeds.py). It imports nothing of the project outside this folder."""
