"""`--workers N`: the supervisor that runs N gateway processes on one port, and what they share."""
