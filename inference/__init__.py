"""Running a trained GPT: KV-cache generation and the choice of each token (decoding.py), the adapter
through which lm-evaluation-harness scores and generates with it (harness.py), and serve.py's parts:
batched generation on a KV cache of slots (batching.py) and the OpenAI-compatible HTTP API over it
(openai_api.py). It imports model.py, tokendata/ and core/."""
