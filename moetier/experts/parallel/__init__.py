"""Routed experts split over ranks behind the ordinary backend interface: expert parallelism (ep.py,
each rank a share of the experts) and tensor parallelism inside each expert (columns.py)."""
