"""Training a draft head on the target's own answers (train_head.py): the answers, the learning, the held-out
measure."""
