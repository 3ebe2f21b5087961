"""Debugging on a rank: pdb with its prompt in the notebook, post-mortem,
the user's frame among library frames, and the cheap traceback of a failed
cell.  May import ``proc`` (the side door's wire) and the leaves.
"""
