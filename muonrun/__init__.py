"""muonrun: a pretraining launcher for LLMs with FSDP2 and distributed Muon."""

__version__ = "0.1.0"
