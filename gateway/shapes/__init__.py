"""API shapes: ``base`` (what a shape is), one module per shape, ``table`` (the ones served).

Empty on purpose: ``gateway/context.py`` imports ``base``, and a shape module may import feature modules
that import the context.
"""
