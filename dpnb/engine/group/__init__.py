"""The process group's lifecycle on one rank: form, re-form, destroy.

Owns a rank's identity and its group (the authenticated rendezvous store
served by rank 0, the addresses and interfaces the communication libraries
use) and, after a re-form, moving what the user holds on the old group to the
new one (``rebind``).  May import ``proc``, ``state``, ``device`` and the
leaves; nothing of training.
"""
