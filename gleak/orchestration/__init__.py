"""Layer 4, orchestration: running trials and keeping their results.

One trial end to end (`trial`), the runner and its workers (local processes or Ray), the results store and what a
stored row may hold, the output folder's manifest, suite files, utility runs, stored reconstructions and plugin
conformance. Layer 3, the built-in plugins, sits at the top of the checkout (attacks/, defenses/, protocols/).
"""
