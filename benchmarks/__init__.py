"""bench.py's parts: the training step's benchmark beside PyTorch's (bench_train.py), its profile read by
model part (bench_profile.py), the attention implementations (bench_attention.py) and the loader against a
remote object store (bench_remote.py). Their records live in bench/. It may import every folder below it."""
