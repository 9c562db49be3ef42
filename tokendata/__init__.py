"""The token data: the on-disk format of a prepared directory and its reading (shards.py), its writers
(shard_writer.py; finetune_data.py for prompt/completion; data_beam.py for Apache Beam), where documents
come from (corpus.py), the step-deterministic loaders with their permutation (loader.py,
permutation.py), and several directories mixed by weight (mixture.py). It knows nothing of models; it
imports only core/."""
