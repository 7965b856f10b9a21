"""hftrain: fine-tune causal LMs with one Accelerator loop, one typed recipe and a launch preset."""

__version__ = "0.1.0"
