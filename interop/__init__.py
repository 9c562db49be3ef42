"""PyTorch and transformers: the PyTorch model alone (torch_gpt.py, which imports nothing of the project and
is the one file to copy next to an export), the transformers layouts' tensor names (hf_layouts.py) and
their config.json both ways (hf_configs.py). It imports training/ (the config), model.py and core/."""
