"""Generation handlers: one base flow (validate → map → open stream → stream or accumulate), two APIs."""
