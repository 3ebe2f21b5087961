"""Engine-side code.

Everything in this package runs *inside* an ipyparallel engine (one engine per
rank).  The notebook never pickles closures to the engines: it calls these
functions by their importable name (``dpnb.engine.setup.init_rank`` ...), so an
engine only ever needs ``import dpnb`` to resolve them.  Each function receives
what it works on explicitly (the engine's user namespace, the process group);
there are no module-level singletons.
"""
