"""Running a trained GPT: KV-cache generation and the choice of each token (decoding.py), and the adapter
through which lm-evaluation-harness scores and generates with it (harness.py). It imports model.py,
tokendata/ and core/."""
