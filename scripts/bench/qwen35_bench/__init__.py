"""Speed benchmarks behind `scripts/bench/bench_train.py` and the train stage of `scripts/device_check.sh`:
our jitted train step against transformers' eager PyTorch one on the same architecture and batch
(`train_step`), checked against a plain transformers process (`anchor`, `plain_transformers`), the
sequence mixers alone (`cores`), our step's pieces alone (`breakdown`), the timing and the tables
they share (`timing`, `report`), and compiled programs read kernel by kernel (`hlo_census`,
`gpu_compile`) or collective by collective (`hlo`).

Not part of the installed library: the scripts beside this folder import it from the checkout.
"""
