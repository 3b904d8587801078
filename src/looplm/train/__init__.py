"""Training: depth samplers, losses, optimizer and schedule, trackers, the trainer loop."""
