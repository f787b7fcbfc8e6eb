"""What train.py uses beyond models, data and parallelisms: process setup, init, optimizer, metrics."""
