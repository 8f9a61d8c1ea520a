"""HearthNet: run one language model across the machines of a household or community LAN."""

__version__ = "0.1.0"
