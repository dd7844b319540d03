"""Layer 1, the contracts: what every other part of gleak speaks.

Pure data types (the client's batch, the update on the wire, the observation, the trial and utility configs),
errors, the plugin registry and the base classes of the plugin kinds. These modules import the standard library,
torch and each other, nothing else of gleak. docs/architecture.md draws the layers.
"""
