"""Speed benchmarks behind `scripts/bench/bench_train.py` and the train stage of `scripts/device_check.sh`:
our jitted train step against transformers' eager PyTorch one on the same architecture and batch
(`train_step`), the sequence mixers alone (`cores`), our step's pieces alone (`breakdown`), and the
timing and the tables they share (`timing`, `report`)."""
