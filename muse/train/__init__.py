"""Training: the default model's pretraining (`muse train pretrain`) and its data."""
