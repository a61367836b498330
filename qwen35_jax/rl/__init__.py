"""Online RL (GRPO): the policy samples on the training mesh, a reward function scores, advantages per
group, clipped PPO updates of the same arrays (docs/rl.md). `scripts/train.py --objective grpo`."""
