"""The commands run on a run's results: browse, show, replay, fork, offline, merge (`uv run -m orchestrate.after.NAME`)."""
