"""verify-resume: a resumed multi-process run must match an uninterrupted one."""
