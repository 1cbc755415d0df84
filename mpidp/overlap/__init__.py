"""The overlapped window: its owner, the pure bucket state, the progress engines and the exact mode's bucket jobs."""
