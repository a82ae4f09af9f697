"""phaseserve: shared package (wire contract, settings, logging, launcher)."""

__version__ = "0.1.0"
