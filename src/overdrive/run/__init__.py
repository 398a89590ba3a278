"""`overdrive run`: offline batch inference over a dataset, resumable (inputs, outputs, resume state, replica, threads, job)."""
