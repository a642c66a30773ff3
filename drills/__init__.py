"""Fault drills of the horde (issue 13): `python -m drills [--short]`, or `make drill`."""
