"""Trainer-side sources of canonical (HF-named) tensors."""
