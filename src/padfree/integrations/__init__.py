"""Glue between padfree and the trainers users already run: TRL's SFTTrainer, the Hugging Face Trainer and
``torch.distributed``. Each module imports its trainer library on use; ``import padfree`` never does."""
