"""Training: depth samplers, optimizer and schedule, checkpoints, the trainer loop."""
