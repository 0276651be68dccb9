"""Opt-in compatibility layers for frameworks that know DeepSpeed and not zerotrain."""
