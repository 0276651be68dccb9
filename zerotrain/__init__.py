"""zerotrain: ZeRO data-parallel training for PyTorch with a DeepSpeed-compatible API."""

__version__ = "0.1.0"
