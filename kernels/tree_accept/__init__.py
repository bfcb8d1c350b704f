"""Tree accept walk: api.py dispatches to reference.py and pallas.py."""
