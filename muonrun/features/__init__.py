"""Optional features that plug into the core through one protocol (muonrun/features/__init__.py)."""
