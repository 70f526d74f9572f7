"""Training loops, optimizers, schedules and checkpoints shared by the training stages."""
