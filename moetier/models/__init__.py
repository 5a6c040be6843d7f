"""Model code, one file per architecture family; shared layers in layers.py."""
