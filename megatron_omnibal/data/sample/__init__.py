"""One sample as stats and training both see it: how it is measured, its text, its media."""
