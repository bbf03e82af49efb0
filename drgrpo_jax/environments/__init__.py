"""Multi-turn episodes: the environment protocol, tools with JSON-schema arguments, the call formats models write,
the built-in calculator and sandboxed Python tools, and the token-exact trajectory driver over the generation
service (every earlier turn kept as token ids; a per-token mask of what the model produced).
"""
