"""Rewards: the built-in reward functions (math-verify, format, task checkers, length penalties) and the user's,
built from the run config's reward section, and the worker pool that runs every call in a time-limited
process and reports timeouts and errors per function.
"""
