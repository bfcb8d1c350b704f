"""Drafter training: sample buffer, loss and train step, warm-up trainer, reduced vocabulary, export."""
