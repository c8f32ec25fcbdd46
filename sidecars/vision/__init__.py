"""CPU vision-encoder sidecar: an image (URL or data: URI) → the engine's ``image_embeds`` and grid.

A separate service with its own settings and dependencies (``pip install warmroute[vision]``); it imports
nothing from the gateway. Run it with ``python -m sidecars.vision --checkpoint DIR --port P``.
"""
