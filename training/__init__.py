"""The training step and what surrounds it: the training's config and its rules (config.py), the optimizer, state and jitted
step placed on the mesh (step.py), the memory and time plan (plan.py), the loop's bookkeeping and its
figures (progress.py, plots.py), the accelerators known (devices.py) and several processes as one run
(multihost.py, with peers.py: a process gone or not answering). It imports model.py, sharding.py, layers/, tokendata/ and core/."""
