"""A node's HTTP interfaces: OpenAI-compatible API, web status page (DESIGN.md decision 13)."""
