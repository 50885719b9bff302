"""The gateway: agent programs of the user's own play episodes through an OpenAI-compatible API of ours,
recorded token-exactly as tapes (server.py: the HTTP side; session.py: one episode's calls; agent.py: the
agent a run with --agent.program plays)."""
