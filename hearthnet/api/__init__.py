"""HTTP interfaces of a node: the OpenAI-compatible API and the web status page (issue 15)."""
