"""The demos of `scripts/train.py --demo sft|grpo` (README): runnable examples built on the library,
which no library module imports."""
