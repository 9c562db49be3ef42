"""pytest set-up shared by every test file.

Multi-device code is tested on 8 simulated CPU devices. XLA reads this flag once, when JAX
initialises its CPU backend, so it is set here, before any test module imports JAX.
"""
import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests never reach the network: Weights & Biases stays off, Hugging Face libraries stay offline.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# lm-eval's local test tasks are built by `datasets`, whose cache goes to a throwaway directory.
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="hf-datasets-"))
