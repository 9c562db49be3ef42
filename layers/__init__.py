"""The GPT's parts below model.py: its config and counts (gpt_config.py: GPTConfig, the parameter and FLOP
counts), attention (ALiBi, rotary, the implementations and their choice) with its kernels (flash_alibi.py
in Pallas, splash.py for TPUs, alibi_dims.py: ALiBi as head dimensions), FP8 matrix products, LoRA's
adapters, the output projection and loss, rematerialisation and the logical axis names. It knows nothing
of runs, storage or data, and imports nothing of the project outside this folder."""
