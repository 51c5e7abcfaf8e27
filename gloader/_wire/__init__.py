"""What both sides read: the messages between the caller and its workers (`protocol`), the
shared-memory segments and their layout (`segment`), per-batch and per-sample seeds (`seed`),
batch structures and plans (`tree`, `plans`). Imports nothing of gloader's above it.
"""
