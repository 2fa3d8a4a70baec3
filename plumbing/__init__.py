"""The plumbing: what a student may skip on a first reading. Nothing here is an equation of the paper.

The concept files at the top level (sft.py, reward_model.py, gae.py, ppo_loss.py, ppo_max.py, train.py, ...) are the
book; this package is what makes them run on a laptop and on 8 GPUs alike. docs/layout.md maps every file.
"""
