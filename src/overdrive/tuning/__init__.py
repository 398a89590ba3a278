"""The optimize flow: the tuner and its guard, plans, the batch-size sweep, the report, and the Python API (`api`)."""
