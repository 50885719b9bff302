"""Agent programs that ship as examples of `--agent.program` (docs/programs.md): plain Python against an
OpenAI client, played through the gateway like any program of the user's own."""
