"""Scheduling: the slot queue (`queue.py`, the policy as data), the fair-share policy it applies
(`fair_share.py`), the engine loop that drives one device's engine and queue (`loop.py`), and
the set of devices the stream service places streams on (`devices.py`)."""
