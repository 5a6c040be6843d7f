"""Model families behind one interface (base.py), found by the registry (registry.py)."""
